"""Reader fuzzing, short run: every mutated input loads or ends in one FormatError naming
its file. The long run is scripts/fuzz_readers.py; every input that ever failed is kept
under tests/fixtures/fuzz/ and replayed here."""

import json
import struct

import fuzz_harness as fh
import pytest
from hypothesis import HealthCheck, given, settings

from mlx_ternary.checkpoint.readers.gguf_file import GGUFFile
from mlx_ternary.errors import FormatError

FORMATS = ("safetensors", "index", "config", "tokenizer", "manifest", "gguf")
CASES = sorted(fh.REGRESSIONS.glob("*.json"))


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return fh.build_seeds(tmp_path_factory.mktemp("seeds"))


@pytest.mark.parametrize("name", FORMATS)
def test_seed_reads(seeds, name, tmp_path):
    """Negative control: the unmutated seed of every format reads."""
    t = seeds[name]
    assert fh.check(t, (t.seed_dir / t.file).read_bytes(), tmp_path) == "read"


@pytest.mark.parametrize("name", FORMATS)
def test_mutations_load_or_name_the_file(seeds, name, tmp_path):
    t = seeds[name]
    seed = (t.seed_dir / t.file).read_bytes()
    outcomes = set()

    @settings(
        max_examples=25,
        deadline=5000,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(fh.mutations(t, seed))
    def run(data):
        outcomes.add(fh.check(t, data, tmp_path))

    run()
    assert "refused" in outcomes  # the mutations reach the checks


@pytest.mark.parametrize("case", CASES, ids=[c.stem for c in CASES])
def test_kept_failures_are_refused(seeds, case, tmp_path):
    """Every input a fuzzing run ever failed on now reads or is refused naming the file."""
    doc = json.loads(case.read_text())
    t = seeds[doc["format"]]
    data = fh.from_case((t.seed_dir / t.file).read_bytes(), doc)
    assert fh.check(t, data, tmp_path) in ("read", "refused")


def test_a_case_round_trips():
    seed, data = b"abcdefgh", b"abXYZgh"
    assert fh.from_case(seed, fh.as_case("x", seed, data)) == data
    assert fh.from_case(seed, fh.as_case("x", seed, b"ab")) == b"ab"


def _safetensors(path, entry):
    raw = json.dumps({"w": entry}).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 64)


@pytest.mark.parametrize(
    "entry,words",
    [
        ({"dtype": "F32", "shape": [2**20, 2**18], "data_offsets": [0, 2**40]}, "truncated"),
        ({"dtype": "F32", "shape": [2**20, 2**18], "data_offsets": [0, 16]}, "16 bytes"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [16]}, "data_offsets"),
        ({"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}, "corrupt"),
        ({"dtype": "F32", "shape": None, "data_offsets": [0, 16]}, "corrupt"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}, "corrupt"),
    ],
)
def test_safetensors_size_claims_refused_from_the_header(tmp_path, entry, words):
    """A header claiming a 1 TB tensor (or a malformed entry) is refused before any read."""
    from mlx_ternary.checkpoint.readers.common import safetensors_header

    f = tmp_path / "model.safetensors"
    _safetensors(f, entry)
    with pytest.raises(FormatError, match=words) as e:
        safetensors_header(f)
    assert str(f) in str(e.value)


def _gguf(path, dims, type_id=0):
    name = b"w"
    raw = b"GGUF" + struct.pack("<IQQ", 3, 1, 0)
    raw += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(dims))
    raw += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", type_id, 0)
    path.write_bytes(raw + b"\0" * (-len(raw) % 32) + b"\0" * 64)


@pytest.mark.parametrize("dims", [(2**18, 2**20), (2**32, 2**32), (2**63, 2), (2**62, 4)], ids=str)
def test_gguf_terabyte_tensor_refused_before_mapping(tmp_path, dims):
    """GGUF dims claiming >= 1 TB, or multiplying past 2**63 (no wrap-around to 0)."""
    path = tmp_path / "big.gguf"
    _gguf(path, dims)
    with pytest.raises(FormatError, match="truncated GGUF file") as e:
        GGUFFile(path)
    assert str(path) in str(e.value)


def test_gguf_small_tensor_control(tmp_path):
    """Negative control: the same file with a 4 x 4 float32 tensor parses."""
    path = tmp_path / "small.gguf"
    _gguf(path, (4, 4))
    (info,) = GGUFFile(path).tensors
    assert info.shape == (4, 4) and info.nbytes == 64


class _Fields:
    """A GGUFFile stand-in: just the metadata fields the tokenizer rebuild reads."""

    def __init__(self, **fields):
        self.fields = {f"tokenizer.ggml.{k}": v for k, v in fields.items()}

    def field(self, key, default=None):
        return self.fields.get(key, default)


@pytest.mark.parametrize(
    "tokens,merges,words",
    [
        (["a", "b", "ab\udcff"], ["a b"], "not valid UTF-8"),  # the UnicodeEncodeError
        (["a", "b", "ab"], ["a zz"], "do not fit"),  # a merge of an unknown token: BPE init
        (["a", 7, "ab"], ["a b"], "arrays of strings"),
        (["a", "b", "ab"], ["ab"], "two tokens"),
    ],
)
def test_gguf_tokenizer_corruptions_are_named(tmp_path, tokens, merges, words):
    from mlx_ternary.checkpoint.readers.gguf_tokenizer import tokenizer_files

    gf = _Fields(model="gpt2", pre="gpt-2", tokens=tokens, merges=merges)
    with pytest.raises(FormatError, match=words) as e:
        tokenizer_files(gf, tmp_path / "m.gguf")
    assert str(tmp_path / "m.gguf") in str(e.value)


def test_gguf_tokenizer_control():
    """Negative control: the same vocabulary, whole, rebuilds and encodes with the merge."""
    from tokenizers import Tokenizer

    from mlx_ternary.checkpoint.readers.gguf_tokenizer import tokenizer_files

    gf = _Fields(model="gpt2", pre="gpt-2", tokens=["a", "b", "ab"], merges=["a b"])
    files = tokenizer_files(gf, "m.gguf")
    assert Tokenizer.from_str(files["tokenizer.json"]).encode("ab").ids == [2]
    assert json.loads(files["tokenizer_config.json"])["tokenizer_class"]
