"""A decode step of the scheduler's running requests: one token each (`PlainDecode`), or their drafts verified in one
step (`SpeculativeDecode`, moetier/engine/speculative.py says how and why). The scheduler holds one, chosen when it
is made; both append through `Scheduler.append`, so what ends a request (EOS, a stop string, max tokens, the KV
row's end) ends it at the same token either way. A step is handed the scheduler rather than keeping it: a scheduler
and its decoder naming each other were a cycle that held a finished call's KV cache (and, after `Engine.close`, the
expert cache) until Python's cycle collector happened to run."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from moetier.engine.request import Request, StepOutput
from moetier.engine.sampling import draw, filtered
from moetier.engine.speculative import Draft, Gate, NgramIndex, Speculation, StepCosts
from moetier.model.batch import StepBatch
from moetier.plan.route import DECODE

if TYPE_CHECKING:
    from moetier.engine.scheduler import Scheduler


class PlainDecode:
    def step(self, s: Scheduler) -> list[StepOutput]:
        start = time.perf_counter()
        running = list(s.running)
        batch = StepBatch.decode_step([r.output[-1] for r in running], [r.row for r in running],
                                      [r.position for r in running], s.kv.rows, device=s.model.device)
        s.begin(DECODE, batch)
        outputs = s.sampled(running, s.model.forward(batch, s.kv.cache))
        s.stats.decode_step_s.append(time.perf_counter() - start)
        s.stats.decode_tokens += len(running)
        return outputs


class SpeculativeDecode:
    def __init__(self, spec: Speculation) -> None:
        self.spec = spec
        self.plain = PlainDecode()
        self.costs = StepCosts()
        self.indices: dict[int, NgramIndex] = {}  # request id -> its context's n-grams
        self.gates: dict[int, Gate] = {}

    def step(self, s: Scheduler) -> list[StepOutput]:
        running = list(s.running)
        self._forget(running)
        drafts = [self._draft(s, r) for r in running]
        start = time.perf_counter()
        if not any(d.tokens for d in drafts):
            outputs = self.plain.step(s)
            self.costs.heard_plain(time.perf_counter() - start)
        else:
            outputs = self._verify(s, running, drafts, start)
        for out in outputs:
            index = self.indices.get(out.id)
            if index is not None:
                index.extend([out.token])
        return outputs

    def _draft(self, s: Scheduler, r: Request) -> Draft:
        """`r`'s draft this step: none where it decodes plainly (penalties or a grammar; its gate shut; no match)."""
        p = r.params
        if p.grammar is not None or p.sampling.shaped:
            return Draft([], 0)
        index = self.indices.get(r.id)
        if index is None:
            index = self.indices[r.id] = NgramIndex(self.spec, r.prompt + r.output)
        room = min(p.sampling.max_new_tokens - len(r.output), s.kv.max_len - r.position) - 1
        found = index.draft()
        found = Draft(found.tokens[:max(0, room)], found.ngram)
        return Draft(found.tokens[:self.gates.setdefault(r.id, Gate(self.spec)).length(found, self.costs)],
                     found.ngram)

    def _verify(self, s: Scheduler, running: list[Request], drafts: list[Draft], start: float) -> list[StepOutput]:
        # a decode step whose rows repeat: request r's tokens at positions p .. p + k of its KV row, each query seeing
        # the keys up to its own position (the drafts before it too: a step writes every token's keys first) — so
        # each token is computed as a decode step computes it, and greedy tokens are plain decoding's, bit for bit
        tokens, rows, positions = [], [], []
        for r, (d, _) in zip(running, drafts):
            tokens += [r.output[-1], *d]
            rows += [r.row] * (len(d) + 1)
            positions += range(r.position, r.position + len(d) + 1)
        batch = StepBatch.decode_step(tokens, rows, positions, s.kv.rows, device=s.model.device)
        s.begin(DECODE, batch)  # (a decode step of several tokens a request: the planner sees them all)
        logits = s.model.forward(batch, s.kv.cache)  # [N, V]
        outputs, first = [], 0
        for r, (d, ngram) in zip(running, drafts):
            own = logits[first:first + len(d) + 1]  # [k + 1, V]: position j predicts the token after it
            first += len(d) + 1
            kept = 0
            for token, j in self._accepted(r, d, own):
                outputs.append(s.append(r, token, own[j]))
                kept += 1
                if r.finished:
                    break
            if d:
                self.gates[r.id].heard(ngram, len(d), kept - 1)
                s.stats.drafted, s.stats.accepted = s.stats.drafted + len(d), s.stats.accepted + kept - 1
        s.leave_finished()
        elapsed = time.perf_counter() - start
        self.costs.heard_verify(elapsed, sum(len(d.tokens) for d in drafts) / len(running))
        s.stats.verify_steps += 1
        per_request = max(1, round(len(outputs) / len(running)))  # a token's share of the step, per request
        s.stats.decode_step_s.extend([elapsed / per_request] * per_request)
        s.stats.decode_tokens += len(outputs)
        return outputs

    def _accepted(self, r: Request, draft: list[int], rows: torch.Tensor) -> list[tuple[int, int]]:
        """(token, its logits row) kept from `draft` and the model's own token after them."""
        p = r.params.sampling
        if p.greedy:
            targets = rows.float().argmax(dim=-1).tolist()  # (as `sample` takes greedy tokens)
            m = 0
            while m < len(draft) and draft[m] == targets[m]:
                m += 1
            return [(draft[j], j) for j in range(m)] + [(targets[m], m)]
        out = []
        for j, token in enumerate(draft):
            probs, ids = filtered(rows[j:j + 1].float(), [p])  # [1, K]: the request's own sampling there
            is_draft = ids == token
            if torch.rand(1, generator=r.generator).item() < float(probs[is_draft].sum()):
                out.append((token, j))
                continue
            rest = ~is_draft  # p without the draft, renormalised (still most likely first, as `draw` reads it)
            residual, rest_ids = probs[rest][None], ids[rest][None]
            u = torch.rand(1, generator=r.generator)
            out.append((int(draw(residual / residual.sum(), rest_ids, u)[0]), j))
            return out
        probs, ids = filtered(rows[-1:].float(), [p])
        out.append((int(draw(probs, ids, torch.rand(1, generator=r.generator))[0]), len(draft)))
        return out

    def _forget(self, running: list[Request]) -> None:
        """Drop the n-grams and gates of requests that left (finished or aborted)."""
        if len(self.gates) > len(running):
            ids = {r.id for r in running}
            self.indices = {i: x for i, x in self.indices.items() if i in ids}
            self.gates = {i: g for i, g in self.gates.items() if i in ids}
