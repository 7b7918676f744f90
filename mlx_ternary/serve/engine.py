"""The generation thread of `serve`: one owner of the model, driving mlx-lm's BatchGenerator.

Handler threads put `Job`s on the engine's inbox and read events from the job's own queue.
Between decode steps the engine admits new jobs: it reuses the longest cached prefix of the
prompt (prompt_cache.py), computes prompt-token logprobs when a job asks for `echo`, and
inserts the rest of the prompt into the running batch (continuous batching, chunked
prefill). A finished sequence's KV cache goes back into the prompt cache. A job is taken
from the inbox only while fewer than `max_concurrency` are active, so the sequences holding
KV buffers are never more (the memory plan's batch): a job waiting inside the generator
would keep the prompt-cache entry its reused prefix views alive after the store evicts it,
and would be merged and prefilled in the very step the sequences it replaces finish, while
their caches (lazy slices of the batch) still hold the batch's old buffers.

A round that raises (admitting, stepping, emitting) fails the requests of its batch with
an "error" event and starts over with an empty batch and empty caches; the requests still
queued, and every later one, are served as usual. Only MAX_FAILED_TURNS failed rounds in a
row (a broken engine, not one bad step) stop it: `healthy` turns False, the server 503s.

Events on `Job.events`: ("prompt_logprobs", [record]), ("text", str, [record]),
("done", finish_reason, completion_tokens), ("error", message). A record is one token's
{"id", "logprob", "top": [(id, logprob)]}.
"""

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional

import mlx.core as mx

from ..errors import TernaryError
from ..format import KV_GROUP_SIZE
from ..speculative import DEFAULT_DRAFT_TOKENS, Acceptance
from .drafting import Speculation
from .kv_quant import make_cache
from .prompt_cache import PromptCache
from .text import TextStream

log = logging.getLogger("mlx_ternary.serve.http")
POLL_S = 0.2
MAX_FAILED_TURNS = 3  # rounds failing in a row before the engine stops (health: 503)
MIN_LOGPROB = -9999.0  # what OpenAI reports for a token the request made impossible
SPECULATING = -1  # the uid of the job decoding speculatively (BatchGenerator's are >= 0)


class _Token(NamedTuple):
    """A speculated token, in the shape _emit reads of BatchGenerator's responses."""

    uid: int
    token: int
    logprobs: mx.array
    finish_reason: Optional[str]


@dataclass
class Job:
    """One request inside the engine: prompt tokens in, events out on `events`."""

    prompt: List[int]
    max_tokens: int
    sampling: dict
    stop: List[str] = field(default_factory=list)
    logprobs: Optional[int] = None  # None: off; else how many top alternatives (0-20)
    echo: bool = False  # prompt-token logprobs first (completions only)
    grammar: Optional[str] = None  # an llguidance grammar the answer must follow
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    cached_tokens: int = 0
    stop_hit: Optional[str] = None  # the stop string that ended the answer
    uid: Optional[int] = None
    text: Optional[TextStream] = None
    pending: str = ""
    records: list = field(default_factory=list)
    tokens: int = 0
    submitted: float = 0.0  # time.monotonic() at submit, then at each token
    started: float = 0.0  # time.monotonic() at submit
    first_token_at: Optional[float] = None  # time.monotonic() at token 1
    last_token_at: Optional[float] = None  # time.monotonic() at the latest token


def _seeded_sampler(temp, top_p, top_k, min_p, seed):
    # A per-request key makes a seeded request reproducible whatever else is in the batch.
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    state = {"key": mx.random.key(seed)}

    def sample(logprobs):
        if 0 < top_p < 1:
            logprobs = apply_top_p(logprobs, top_p)
        if min_p:
            logprobs = apply_min_p(logprobs, min_p)
        if top_k:
            logprobs = apply_top_k(logprobs, top_k)
        state["key"], sub = mx.random.split(state["key"])
        return mx.random.categorical(logprobs * (1.0 / temp), key=sub)

    return sample


def make_sampler(s: dict):
    """A sampler for one request's sampling dict (greedy at temperature 0)."""
    from mlx_lm.sample_utils import greedy_sampler
    from mlx_lm.sample_utils import make_sampler as mlx_sampler

    if s["temperature"] == 0:
        return greedy_sampler  # shared: the batch then samples in one call
    if s.get("seed") is not None:
        return _seeded_sampler(s["temperature"], s["top_p"], s["top_k"], s["min_p"], s["seed"])
    return mlx_sampler(s["temperature"], s["top_p"], s["min_p"], top_k=s["top_k"])


def token_records(logprobs: mx.array, chosen: List[int], top: int) -> List[dict]:
    """Per position i: the logprob of `chosen[i]` in row i of `logprobs` (rows, vocab) and
    the `top` most likely tokens with theirs."""
    rows = mx.arange(len(chosen))
    picked = logprobs[rows, mx.array(chosen)]
    if top:
        idx = mx.argpartition(-logprobs, top - 1, axis=-1)[:, :top]
        vals = mx.take_along_axis(logprobs, idx, axis=-1)
        order = mx.argsort(-vals, axis=-1)
        idx, vals = mx.take_along_axis(idx, order, -1), mx.take_along_axis(vals, order, -1)
        mx.eval(picked, idx, vals)
        tops = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    else:
        mx.eval(picked)
        tops = [[] for _ in chosen]
    clamp = lambda v: max(float(v), MIN_LOGPROB)  # noqa: E731
    return [
        {"id": t, "logprob": clamp(p), "top": [(i, clamp(v)) for i, v in tp]}
        for t, p, tp in zip(chosen, picked.tolist(), tops)
    ]


class Engine:
    """The generation thread: admits jobs, steps the BatchGenerator, emits events."""

    def __init__(
        self,
        model,
        tokenizer,
        max_concurrency: int = 8,
        prefill_step_size: int = 512,
        kv_bits: Optional[int] = None,
        kv_group_size: int = KV_GROUP_SIZE,
        prompt_cache_bytes: int = 0,
        grammars=None,
        draft_model=None,
        num_draft_tokens: int = DEFAULT_DRAFT_TOKENS,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.max_concurrency = max_concurrency
        self.prefill_step_size = prefill_step_size
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.prompt_cache = PromptCache(prompt_cache_bytes)
        self.grammars = grammars
        self.inbox: queue.Queue = queue.Queue()
        self.active = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self.run_loop, name="mlx-ternary-engine", daemon=True
        )
        self.failed: Optional[str] = None
        self.tokens_generated = 0
        self.prompt_tokens_computed = 0
        self.metrics = None  # a serve.metrics.Metrics, when the server keeps them
        self._gen = None
        # Speculative decoding (drafting.py): the draft, the one job it runs, the counts.
        self.draft_model, self.num_draft_tokens = draft_model, num_draft_tokens
        self.speculation: Optional[Speculation] = None
        self.draft_tokens_proposed = self.draft_tokens_accepted = 0

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()
        if self._thread.ident is not None:  # started (a server that failed to bind never is)
            self._thread.join(timeout=30)

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and self.failed is None

    def load(self) -> int:
        """Jobs waiting or running."""
        return self.inbox.qsize() + len(self.active)

    def submit(self, job: Job):
        job.submitted = job.started = time.monotonic()
        self.inbox.put(job)

    def kv_bytes(self) -> int:
        """Bytes of the running batch's KV cache."""
        gen, spec = self._gen, self.speculation
        try:
            batch = int(gen.prompt_cache_nbytes) if gen is not None else 0
            return batch + (spec.nbytes() if spec is not None else 0)
        except Exception:  # read while the generation thread changes the batch
            return 0

    def _new_generator(self, stream):
        from mlx_lm.generate import BatchGenerator, make_stop_sequences

        self._stops = make_stop_sequences(self.tokenizer)
        self._gen = BatchGenerator(
            self.model,
            completion_batch_size=self.max_concurrency,
            prefill_batch_size=self.max_concurrency,
            prefill_step_size=self.prefill_step_size,
            stream=stream,
        )
        return self._gen

    def run_loop(self):
        try:
            stream = mx.default_stream(mx.default_device())
            gen = self._new_generator(stream)
            failures = 0  # turns failed in a row
            while not self._stop.is_set():
                failure = self._turn(gen)
                if failure is None:
                    failures = 0
                    continue
                failures += 1
                if failures >= MAX_FAILED_TURNS:
                    raise TernaryError(f"{failures} generation steps failed in a row ({failure})")
                gen = self._gen = None  # the failed batch and its KV caches go now
                gen = self._reset(stream, failure)
        except Exception as e:
            log.exception("engine thread died")
            self.failed = f"{type(e).__name__}: {e}"
            self._fail_all("the generation engine stopped")

    def _turn(self, gen) -> Optional[str]:
        """One round: admit, drop the cancelled, step the batch. None when it went well,
        else what failed: a failed round fails its batch, not the server."""
        try:
            self._admit(gen, block=not self.active)
            self._drop_cancelled(gen)
            if self.active:
                self._step(gen)
        except Exception as e:
            log.exception("generation step failed")
            return f"generation failed ({type(e).__name__})"  # the details go to the log
        return None

    def _reset(self, stream, failure: str):
        """After a failed round: every request of the batch gets the error (in its API's
        shape, from the handlers), the prompt cache and MLX's buffer cache are emptied, and
        a new, empty batch generator takes the next requests."""
        self._fail_all(f"{failure}; the request was not completed, retry it")
        self.prompt_cache.clear()
        mx.clear_cache()
        return self._new_generator(stream)

    def _fail_all(self, message: str):
        for job in self.active.values():
            job.events.put(("error", message))
        self.active.clear()
        self.speculation = None

    def _step(self, gen):
        # A method, so the responses (each finished one holds its KV cache) die on return.
        if self.speculation is not None:
            return self._speculate(gen)
        with mx.stream(gen.stream):
            _, responses = gen.next()
        for r in responses:
            self._emit(gen, r)

    def _admit(self, gen, block: bool):
        while len(self.active) < self.max_concurrency:
            try:
                job = self.inbox.get(timeout=POLL_S) if block else self.inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if self.speculation is not None:  # a second job: the speculating one joins the batch
                self._batch_speculation(gen)
            if not job.cancelled.is_set():
                self._start(gen, job)

    def _start(self, gen, job: Job):
        """Insert one job; one that cannot start (a grammar, a prompt) fails alone."""
        try:
            self._insert(gen, job)
        except Exception as e:
            log.exception("admitting a request failed")
            job.events.put(("error", f"the request could not start ({type(e).__name__})"))

    def _insert(self, gen, job: Job):
        from mlx_lm.sample_utils import make_logits_processors

        with mx.stream(gen.stream):
            if job.echo:
                job.events.put(("prompt_logprobs", self._prompt_logprobs(job)))
            if job.max_tokens == 0:
                job.events.put(("done", "length", 0))
                return
            cache, n = self.prompt_cache.fetch(job.prompt)
            job.cached_tokens = n
            if cache is None:
                cache = make_cache(self.model, self.kv_bits, self.kv_group_size)
        self.prompt_tokens_computed += len(job.prompt) - n
        s = job.sampling
        procs = make_logits_processors(
            s.get("logit_bias"),
            s.get("repetition_penalty"),
            20,
            s.get("presence_penalty"),
            20,
            s.get("frequency_penalty"),
            20,
        )
        if job.grammar is not None:
            procs.append(self.grammars.processor(job.grammar))
        job.text = TextStream(self.tokenizer, job.prompt)
        if self._speculates(job):
            return self._start_speculation(gen, job, cache, n, procs)
        (job.uid,) = gen.insert(
            [job.prompt[n:]],
            max_tokens=[job.max_tokens],
            caches=[cache],
            all_tokens=[list(job.prompt[:n])],
            samplers=[make_sampler(s)],
            logits_processors=[procs],
            stop_sequences=[self._stops],
        )
        self.active[job.uid] = job

    def _prompt_logprobs(self, job: Job) -> List[dict]:
        """Records for prompt tokens 1.. (the first has no logprob), from one chunked
        forward pass; its KV cache then serves the generation through the prompt cache."""
        tokens = job.prompt
        cache = make_cache(self.model, self.kv_bits, self.kv_group_size)
        top = job.logprobs or 0
        records = []
        for start in range(0, len(tokens), self.prefill_step_size):
            chunk = tokens[start : start + self.prefill_step_size]
            logits = self.model(mx.array(chunk)[None], cache=cache)[0].astype(mx.float32)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            nxt = tokens[start + 1 : start + 1 + len(chunk)]
            if nxt:
                records += token_records(logprobs[: len(nxt)], nxt, top)
            mx.eval([c.state for c in cache])
        self.prompt_tokens_computed += len(tokens)
        self.prompt_cache.insert(tokens, cache)
        return records

    def _drop_cancelled(self, gen):
        gone = [uid for uid, job in self.active.items() if job.cancelled.is_set()]
        if SPECULATING in gone:
            gone.remove(SPECULATING)
            del self.active[SPECULATING]
            self.speculation = None
        if gone:
            gen.remove(gone)
            for uid in gone:
                del self.active[uid]

    def _emit(self, gen, r):
        job = self.active.get(r.uid)
        if job is None:
            return
        job.tokens += 1
        self.tokens_generated += 1
        now = time.monotonic()
        if job.tokens == 1:
            job.first_token_at = now
        job.last_token_at = now
        if self.metrics is not None:
            (self.metrics.first_token if job.tokens == 1 else self.metrics.next_token)(
                now - job.submitted
            )
            job.submitted = now
        if job.logprobs is not None:
            job.records += token_records(r.logprobs[None], [r.token], job.logprobs)
        text = job.text.add(r.token) if r.finish_reason != "stop" else ""  # EOS is no text
        if r.finish_reason is not None:
            text += job.text.flush()
        text, reason = self._apply_stop(job, text, reason=r.finish_reason)
        if text or (reason is not None and job.records):
            job.events.put(("text", text, job.records))
            job.records = []
        if reason is None:
            return
        job.events.put(("done", reason, job.tokens))
        del self.active[r.uid]
        if r.uid == SPECULATING:
            self._finish_speculation(job)
        elif r.finish_reason is not None:
            self.prompt_cache.insert(r.all_tokens, r.prompt_cache)
        else:  # a stop string ended it: leave the batch, keep its cache
            kept = gen.remove([r.uid], return_prompt_caches=True).get(r.uid)
            if kept is not None:
                self.prompt_cache.insert(kept[1], kept[0])

    # Speculative decoding: one job alone, by mlx-lm's speculative_generate_step (drafting.py).

    def _speculates(self, job: Job) -> bool:
        """Speculate for a job that starts alone: nothing running, nothing waiting. Not
        for a grammar: its matcher cannot step back over rejected draft tokens."""
        return (
            self.draft_model is not None
            and not self.active
            and self.inbox.empty()
            and job.grammar is None
        )

    def _start_speculation(self, gen, job: Job, cache: list, cached: int, procs: list):
        self.speculation = Speculation(
            self.model,
            self.draft_model,
            job.prompt,
            cache,
            cached,
            max_tokens=job.max_tokens,
            sampler=make_sampler(job.sampling),
            processors=procs,
            acceptance=Acceptance(self.num_draft_tokens, job.max_tokens),
            eos_ids=self.tokenizer.eos_token_ids,
            prefill_step_size=self.prefill_step_size,
            kv_bits=self.kv_bits,
            kv_group_size=self.kv_group_size,
            stream=gen.stream,
        )
        job.uid = SPECULATING
        self.active[SPECULATING] = job

    def _speculate(self, gen):
        """One round (draft, verify, accept) of the speculating job, its tokens emitted."""
        spec = self.speculation
        drafted, accepted = spec.acceptance.drafted, spec.acceptance.accepted
        with mx.stream(gen.stream):
            tokens = spec.round()
        self.draft_tokens_proposed += spec.acceptance.drafted - drafted
        self.draft_tokens_accepted += spec.acceptance.accepted - accepted
        for token, logprobs, reason in tokens:
            if SPECULATING not in self.active:
                break  # a stop string ended it inside the round
            self._emit(gen, _Token(SPECULATING, token, logprobs, reason))

    def _finish_speculation(self, job: Job):
        """The speculating job ended: its KV cache goes to the prompt cache."""
        spec, self.speculation = self.speculation, None
        cache, tokens, _ = spec.close(job.tokens)
        self.prompt_cache.insert(tokens, cache)

    def _batch_speculation(self, gen):
        """Stop speculating, between rounds: the job goes on in the batch from its KV cache,
        as a prompt-cache hit would."""
        spec, job = self.speculation, self.active[SPECULATING]
        cache, tokens, rest = spec.close(job.tokens)
        (uid,) = gen.insert(
            [rest],
            max_tokens=[job.max_tokens - job.tokens],
            caches=[cache],
            all_tokens=[tokens],
            samplers=[spec.sampler],
            logits_processors=[spec.processors],
            stop_sequences=[self._stops],
        )
        del self.active[SPECULATING]
        job.uid, self.active[uid], self.speculation = uid, job, None

    @staticmethod
    def _apply_stop(job: Job, text: str, reason: Optional[str]):
        """Cut the text at the first stop string; hold back a possible stop-string prefix."""
        if not job.stop:
            return text, reason
        job.pending += text
        cut = [(i, s) for i, s in ((job.pending.find(s), s) for s in job.stop) if i >= 0]
        if cut:
            i, job.stop_hit = min(cut)
            out, job.pending = job.pending[:i], ""
            return out, "stop"
        if reason is not None:
            out, job.pending = job.pending, ""
            return out, reason
        hold = 0
        for s in job.stop:
            for n in range(min(len(s) - 1, len(job.pending)), 0, -1):
                if job.pending.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        out = job.pending[: len(job.pending) - hold]
        job.pending = job.pending[len(out) :]
        return out, None
