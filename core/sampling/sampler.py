"""The batched sampler: one next token per request from a [R, V] block of logits.

Order per row (vLLM's): logprobs from the raw logits; min_tokens bans; repetition, frequency and
presence penalties; then greedy argmax, or temperature, top-k, top-p, min-p and a random draw.
Seeded requests draw from their own generator, so their tokens do not depend on the batch they are in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pegainfer import ops
from pegainfer.engine.outputs import Logprob, PositionLogprobs
from pegainfer.engine.request import Request
from pegainfer.sampling.sampling_params import SamplingParams
from pegainfer.sampling.structured import allowed_tokens

_NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    """The chosen token of each row, and its logprobs where the request asked for them."""

    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]


class HostBuffers:
    """Pinned host tensors and CUDA events for :class:`HostCopy`, handed out again once a copy's reader
    has released them: allocating pinned memory and an event costs host time every step otherwise."""

    _MAX_FREE = 4  # kept per dtype and shape (a steady batch reuses one or two)

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, torch.Size], list[torch.Tensor]] = {}
        self._events: list[torch.cuda.Event] = []

    def tensor(self, like: torch.Tensor) -> torch.Tensor:
        free = self._free.get((like.dtype, like.shape))
        return free.pop() if free else torch.empty(like.shape, dtype=like.dtype, pin_memory=True)

    def event(self) -> torch.cuda.Event:
        return self._events.pop() if self._events else torch.cuda.Event()

    def release(self, tensors: list[torch.Tensor], event: torch.cuda.Event) -> None:
        for t in tensors:
            free = self._free.setdefault((t.dtype, t.shape), [])
            if len(free) < self._MAX_FREE:
                free.append(t)
        self._events.append(event)


class HostCopy:
    """Device tensors copied into host memory without blocking the host (pinned buffers and an event from
    ``buffers`` on CUDA; a plain copy elsewhere); :meth:`wait` before reading them, :meth:`release` once
    read hands the pinned buffers and the event back."""

    def __init__(self, tensors: dict[str, torch.Tensor], buffers: HostBuffers) -> None:
        self._event = None
        self._buffers = buffers
        self.host: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            host = buffers.tensor(t) if t.is_cuda else torch.empty(t.shape, dtype=t.dtype)
            self.host[name] = host.copy_(t, non_blocking=t.is_cuda)
            if t.is_cuda and self._event is None:
                self._event = buffers.event()
        if self._event is not None:
            self._event.record()

    def wait(self) -> dict[str, torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
        return self.host

    def release(self) -> None:
        """After :meth:`wait`, when nothing reads ``host`` any more: its buffers may take the next copy."""
        if self._event is not None:
            self._buffers.release(list(self.host.values()), self._event)
        self.host, self._event = {}, None


@dataclass
class DeviceSample:
    """A sampler call whose tokens are still on their way to the host."""

    tokens: torch.Tensor  # [R] on the logits' device
    logprob_rows: list[int]
    logprob_ks: list[int]
    copy: HostCopy
    _output: SamplerOutput | None = None

    def result(self) -> SamplerOutput:
        """Wait for the copy (only the work queued before the sample, not anything queued since). The host
        buffers go back to the sampler once read; later calls return the same output."""
        if self._output is not None:
            return self._output
        host = self.copy.wait()
        logprobs: list[PositionLogprobs | None] = [None] * self.tokens.shape[0]
        if self.logprob_rows:
            entries = _position_entries(host, self.logprob_ks)
            for i, entry in zip(self.logprob_rows, entries, strict=True):
                logprobs[i] = entry
        self._output = SamplerOutput(token_ids=host["chosen"].tolist(), logprobs=logprobs)
        self.copy.release()
        return self._output


class Sampler:
    """Picks the next token for every row of a logits block.

    A request with ``sampling_params.seed`` gets a ``torch.Generator`` stored on the request as
    ``request.generator`` on first use; every other random row draws from the sampler's own generator.
    """

    def __init__(self, *, seed: int = 0, device: torch.device | str | None = None) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._host_buffers = HostBuffers()
        # The last batch's requests and what _scan found in them: a decode batch repeats step after step.
        self._scanned: list[Request] = []
        self._scan_result: tuple[list[int], list[int], bool, list[int]] = ([], [], False, [])
        if device is not None:
            # An empty tensor names the device as logits will (``cuda`` becomes ``cuda:0``).
            self._generator(torch.empty(0, device=device).device)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """Return one token per row of ``logits`` [R, V]; row i is the next token of ``requests[i]``."""
        return self.sample(logits, requests).result()

    def sample(
        self, logits: torch.Tensor, requests: list[Request], greedy: torch.Tensor | None = None
    ) -> DeviceSample:
        """Choose the tokens on the device and start copying them (and any logprobs) to the host; nothing
        here waits for the GPU, so the engine can queue the next step before reading them. ``greedy``, when
        given, is ``logits.argmax(-1)`` computed already (the decode graph's): an all-greedy batch takes it as
        it is, a mixed one a copy with the other rows' draws written in."""
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits must be [{len(requests)}, V], got {tuple(logits.shape)}")
        lp_rows, random_rows, adjusted, grammar_rows = self._scan(requests)
        adjusted = adjusted or bool(grammar_rows)
        # Taken before anything touches the logits: logprobs describe the model, not the sampler.
        raw_logprobs = torch.log_softmax(_rows(logits, lp_rows).float(), dim=-1) if lp_rows else None

        penalized = _penalized_or_none(logits, requests) if adjusted else None
        # Untouched logits stay in their own dtype: argmax agrees with float32's, and the copy is skipped.
        work = logits if penalized is None else penalized
        if penalized is not None:  # penalties change the argmax
            greedy = None
        if not random_rows:
            chosen = ops.argmax(work) if greedy is None else greedy
        elif len(random_rows) == len(requests):
            chosen = self._sample(work, requests)
        else:
            # A copy of the given greedy tokens: they belong to the executor (an inference tensor there).
            chosen = ops.argmax(work) if greedy is None else greedy.clone()
            index = _index(random_rows, work.device)
            chosen[index] = self._sample(work[index], [requests[i] for i in random_rows])

        tensors = {"chosen": chosen}
        ks = [requests[i].sampling_params.logprobs or 0 for i in lp_rows]
        if raw_logprobs is not None:
            tensors.update(_logprob_tensors(raw_logprobs, _rows(chosen, lp_rows), max(ks)))
        return DeviceSample(chosen, lp_rows, ks, HostCopy(tensors, self._host_buffers))

    def rows_independent(self, requests: list[Request], drafts: list[list[int]] | None = None) -> bool:
        """Whether each request's token comes from its logits row alone (greedy, no penalties, no
        ``min_tokens`` bans, no grammar): then several rows of one request sampled in one call choose what
        they would one after another, each after the tokens before it were appended. A grammar waiting for
        a token (``Request.deferred_grammar``) starts inside the rows only where that token is among the
        request's ``drafts`` (None: assume it is)."""
        _, random_rows, adjusted, grammar_rows = self._scan(requests)
        if random_rows or adjusted:
            return False
        for i in grammar_rows:
            deferred = requests[i].deferred_grammar
            if deferred is None or drafts is None or deferred[0] in drafts[i]:
                return False  # a grammar on, or one that may start inside the rows
        return True

    def _scan(self, requests: list[Request]) -> tuple[list[int], list[int], bool, list[int]]:
        """The rows that want logprobs, the rows that draw at random, whether any row needs penalties,
        biases or bans, and the rows with a grammar (on or waiting): one pass over the rows, or none when
        the requests are the last call's (a request's sampling params never change, and a grammar row stays
        one when its waiting grammar starts)."""
        if requests == self._scanned:  # identity per element: Request has no __eq__
            return self._scan_result
        lp_rows, random_rows, adjusted, grammar_rows = [], [], False, []
        for i, request in enumerate(requests):
            p = request.sampling_params
            if p.logprobs is not None:
                lp_rows.append(i)
            if not p.greedy:
                random_rows.append(i)
            if request.grammar is not None or request.deferred_grammar is not None:
                grammar_rows.append(i)
            if p.min_tokens or p.logit_bias or p.allowed_token_ids or _needs_penalties(p):
                adjusted = True
        self._scanned, self._scan_result = list(requests), (lp_rows, random_rows, adjusted, grammar_rows)
        return self._scan_result

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self._seed)
            self._generators[device] = gen
        return gen

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Draw one token per row (all non-greedy) after temperature, top-k, top-p and min-p."""
        params = [r.sampling_params for r in requests]
        device = logits.device
        vocab = logits.shape[1]
        temps = torch.tensor([p.temperature for p in params], device=device)
        x = logits.float() / temps[:, None]

        filtered = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
        if filtered:
            ks = torch.tensor([params[i].top_k if params[i].top_k > 0 else vocab for i in filtered])
            ps = torch.tensor([params[i].top_p for i in filtered])
            if len(filtered) == len(params):
                x = _top_k_top_p(x, ks.to(device), ps.to(device))
            else:
                index = _index(filtered, device)
                x[index] = _top_k_top_p(x[index], ks.to(device), ps.to(device))

        if any(p.min_p > 0.0 for p in params):
            # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p); log(0) = -inf keeps everything.
            log_min_p = torch.tensor([math.log(p.min_p) if p.min_p > 0 else _NEG_INF for p in params])
            threshold = x.amax(dim=-1, keepdim=True) + log_min_p.to(device)[:, None]
            x = x.masked_fill(x < threshold, _NEG_INF)

        probs = torch.softmax(x, dim=-1)
        noise = torch.empty_like(probs)
        unseeded = []
        for i, (req, p) in enumerate(zip(requests, params, strict=True)):
            if p.seed is None:
                unseeded.append(i)
            else:
                noise[i].exponential_(generator=_request_generator(req, device))
        if len(unseeded) == len(params):
            noise.exponential_(generator=self._generator(device))
        elif unseeded:
            draws = torch.empty(len(unseeded), vocab, device=device)
            noise[_index(unseeded, device)] = draws.exponential_(generator=self._generator(device))
        # Exponential race: argmax p_i / E_i with E_i ~ Exp(1) picks i with probability p_i.
        # The clamp keeps a (vanishingly rare) zero draw from turning a banned token's 0/0 into NaN.
        return probs.div_(noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Return float32 logits with logit biases, structured-output masks, min_tokens bans and
    repetition/frequency/presence penalties applied.

    The input is never modified; when no row needs anything the result may be the input itself.
    """
    penalized = _penalized_or_none(logits, requests)
    return logits.float() if penalized is None else penalized


def _penalized_or_none(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor | None:
    """``apply_penalties``, or None (and no copy) when no row needs anything."""
    vocab = logits.shape[1]
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    penalty_rows: list[int] = []
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    biases: list[float] = []
    grammar_rows: list[int] = []
    allow_rows: list[int] = []
    allow_ids: list[int] = []
    for i, req in enumerate(requests):
        p = req.sampling_params
        if req.grammar is not None:
            grammar_rows.append(i)
        if p.allowed_token_ids:
            # Ids past the logits are refused at admission where the model's vocabulary is known.
            allowed = [t for t in p.allowed_token_ids if t < vocab]
            allow_rows.extend([i] * len(allowed))
            allow_ids.extend(allowed)
        if p.logit_bias:
            bias_rows.extend([i] * len(p.logit_bias))
            bias_ids.extend(p.logit_bias)
            biases.extend(p.logit_bias.values())
        # (min_tokens 0 bans nothing: a request never has fewer than 0 output tokens.)
        if p.min_tokens and req.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids or ())
            if not p.ignore_eos:
                banned.extend(p.eos_token_ids)
            # User-given stop ids are not checked against this model's vocab anywhere earlier.
            banned = [t for t in banned if 0 <= t < vocab]
            ban_rows.extend([i] * len(banned))
            ban_ids.extend(banned)
        if _needs_penalties(p):
            penalty_rows.append(i)
    if not ban_rows and not penalty_rows and not bias_rows and not grammar_rows and not allow_rows:
        return None

    work = logits.to(torch.float32, copy=True)
    if bias_rows:  # before the bans (a banned token stays banned) and the penalties, as vLLM orders them
        rows, ids = _index(bias_rows, work.device), _index(bias_ids, work.device)
        work[rows, ids] += torch.tensor(biases, dtype=torch.float32, device=work.device)
    if allow_rows:  # allowed_token_ids: every other token out, before the grammar narrows further
        rows = sorted(set(allow_rows))
        at = {row: j for j, row in enumerate(rows)}
        keep = torch.zeros((len(rows), work.shape[1]), dtype=torch.bool, device=work.device)
        keep[_index([at[row] for row in allow_rows], work.device), _index(allow_ids, work.device)] = True
        limited = _index(rows, work.device)
        work[limited] = work[limited].masked_fill(~keep, _NEG_INF)
    grammar_index = _index(grammar_rows, work.device) if grammar_rows else None
    if grammar_index is not None:  # what the structured output allows next, from the tokens appended so far
        allowed = allowed_tokens([requests[i].grammar for i in grammar_rows], vocab, work.device)
        work[grammar_index] = work[grammar_index].masked_fill(~allowed, _NEG_INF)
    if ban_rows:
        limited_rows = sorted(set(grammar_rows) | set(allow_rows))
        limited = _index(limited_rows, work.device) if limited_rows else None
        masked = work[limited] if limited is not None else None  # a copy (advanced indexing)
        work[_index(ban_rows, work.device), _index(ban_ids, work.device)] = _NEG_INF
        if masked is not None:
            # Where the grammar or allowed_token_ids leave only banned tokens (min_tokens' stop ids, EOS),
            # they win: the answer stays valid. Decided on the device, no sync.
            stuck = torch.isneginf(work[limited]).all(dim=1, keepdim=True)
            work[limited] = torch.where(stuck, masked, work[limited])
    if penalty_rows:
        if len(penalty_rows) == len(requests):
            work = _penalize(work, requests)
        else:
            index = _index(penalty_rows, work.device)
            work[index] = _penalize(work[index], [requests[i] for i in penalty_rows])
    return work


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: list[int], k: int) -> list[PositionLogprobs]:
    """Logprobs of ``target_ids[t]`` under row t of ``logits`` [T, V], plus the k most likely tokens.

    Row t is the model's output at prompt position t, so the caller passes the prompt shifted by one.
    """
    if logits.dim() != 2 or logits.shape[0] != len(target_ids):
        raise ValueError(f"logits must be [{len(target_ids)}, V], got {tuple(logits.shape)}")
    if not target_ids:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(target_ids, device=logits.device)
    return _position_logprobs(logprobs, targets, [k] * len(target_ids))


def _needs_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


class _PenaltyState:
    """A request's token statistics for the penalties, kept on the request and updated with only the
    tokens added since the last step, so a penalized request costs O(V) per step, not O(length)."""

    def __init__(self, request: Request, vocab: int, device: torch.device) -> None:
        self.in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.in_prompt[torch.tensor(request.prompt_token_ids, dtype=torch.long, device=device)] = True
        self.output_counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.counted = request.num_prompt_tokens

    def update(self, request: Request) -> None:
        new = request.all_token_ids[self.counted :]
        if new:
            ids = torch.tensor(new, dtype=torch.long, device=self.output_counts.device)
            self.output_counts.index_add_(0, ids, torch.ones(len(new), device=ids.device))
            self.counted = request.num_tokens


def _penalty_state(request: Request, vocab: int, device: torch.device) -> _PenaltyState:
    state = request.penalty_state
    if not isinstance(state, _PenaltyState) or state.output_counts.device != device:
        state = request.penalty_state = _PenaltyState(request, vocab, device)
    state.update(request)
    return state


def _penalize(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Apply each row's repetition, frequency and presence penalties; returns a new tensor."""
    vocab, device = logits.shape[1], logits.device
    params = [r.sampling_params for r in requests]
    states = [_penalty_state(r, vocab, device) for r in requests]
    counts = torch.stack([st.output_counts for st in states])
    # Only the repetition penalty looks at the prompt.
    seen = torch.stack([st.in_prompt for st in states]) | (counts > 0)

    rep = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    out = torch.where(seen & (rep != 1.0), penalized, logits)
    return out - freq * counts - presence * (counts > 0).float()


def _top_k_top_p(x: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    """Mask to -inf all but each row's top ``ks`` tokens, then all but its smallest top-``ps`` set."""
    sorted_x, order = x.sort(dim=-1, descending=True)
    positions = torch.arange(x.shape[1], device=x.device)
    drop = positions >= ks[:, None]
    probs = torch.softmax(sorted_x.masked_fill(drop, _NEG_INF), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # A token is kept while the mass of better tokens is still short of top_p, so the top token always is;
    # rows with top_p == 1 are exempt so rounding in the cumsum cannot cut their tail.
    drop |= (mass_before >= ps[:, None]) & (ps < 1.0)[:, None]
    unsorted_drop = torch.empty_like(drop).scatter_(1, order, drop)
    return x.masked_fill(unsorted_drop, _NEG_INF)


def _logprob_tensors(logprobs: torch.Tensor, chosen: torch.Tensor, max_k: int) -> dict[str, torch.Tensor]:
    """The device half of the logprobs of each row: the chosen token's logprob and rank, the top ``max_k``."""
    chosen_lp = logprobs.gather(1, chosen[:, None]).squeeze(1)
    top_lp, top_ids = logprobs.topk(min(max_k, logprobs.shape[1]), dim=-1)
    return {
        "lp_chosen": chosen,
        "lp_value": chosen_lp,
        "lp_rank": (logprobs > chosen_lp[:, None]).sum(dim=-1) + 1,
        "lp_top": top_lp,
        "lp_top_ids": top_ids,
    }


def _position_entries(host: dict[str, torch.Tensor], ks: list[int]) -> list[PositionLogprobs]:
    """The host half: one PositionLogprobs per row from the tensors of :func:`_logprob_tensors`."""
    chosen, value, rank = host["lp_chosen"].tolist(), host["lp_value"].tolist(), host["lp_rank"].tolist()
    top_lp, top_ids = host["lp_top"].tolist(), host["lp_top_ids"].tolist()
    out: list[PositionLogprobs] = []
    for row, k in enumerate(ks):
        entry = {chosen[row]: Logprob(logprob=value[row], rank=rank[row])}
        for j in range(min(k, len(top_ids[row]))):
            entry[top_ids[row][j]] = Logprob(logprob=top_lp[row][j], rank=j + 1)
        out.append(entry)
    return out


def _position_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, ks: list[int]) -> list[PositionLogprobs]:
    """For each row, the chosen token's logprob and rank, plus the row's top ``ks[i]`` tokens."""
    return _position_entries(_logprob_tensors(logprobs, chosen, max(ks)), ks)


def _request_generator(request: Request, device: torch.device) -> torch.Generator:
    gen: torch.Generator | None = getattr(request, "generator", None)
    if gen is None:
        gen = torch.Generator(device=device)
        gen.manual_seed(request.sampling_params.seed)
        request.generator = gen  # type: ignore[attr-defined]
    return gen


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``t[rows]``, without a gather when ``rows`` is every row in order."""
    return t if len(rows) == t.shape[0] else t[_index(rows, t.device)]
