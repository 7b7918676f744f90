"""server_close ends the connections clients keep open (HTTP/1.1 keep-alive), so no handler
thread, and nothing it holds (the model), outlives the server."""

import http.client
import threading

from tiny import ternary_checkpoint

import mlx_ternary
from mlx_ternary.serve.http import ServeConfig, Server


def test_server_close_ends_idle_keep_alive_connections(tmp_path):
    path, _ = ternary_checkpoint(tmp_path, "llama")
    model, tok = mlx_ternary.load(str(path))
    config = ServeConfig(model_name="tiny", max_context=64, read_timeout=60.0)
    server = Server(model, tok, config, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    clients = []
    for _ in range(3):  # answered, then left open: each holds a handler thread for 60 s
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
        conn.request("GET", "/health")
        assert conn.getresponse().read()
        clients.append(conn)
    assert server.connections == 3  # control: the connections are open before the close
    server.shutdown()
    server.server_close()
    assert server.connections == 0 and not server.open_sockets
    assert not any(t.name == "mlx-ternary-engine" and t.is_alive() for t in threading.enumerate())
    for conn in clients:
        conn.close()
