"""The scheduler side of the connector (runs in vLLM's engine-core process).

It owns no KV and no pins: it asks the workers' Engines over the lookup channel and turns
vLLM's scheduling decisions into per-step load and save specs; what it remembers of each
request is a :class:`~.request_state.RequestState`.

Hits count in whole chunks (the Engine), then whole vLLM blocks, and never the prompt's last
token (vLLM needs its logits)::

    prompt  |--------------------------------------------|  n
    hit     |=========chunk=========|=========chunk======|   (all n cached)
    usable  |===|===|===|===|===|===|===|===|===|===|===|    floor((min(hit, n-1)) / block)
    vLLM    |===|===|                                        its own prefix cache (local)
    load            |===|===|===|===|===|===|===|===|===|    usable - local

PD (a prefiller's transfer id and a decoder's pull, through the proxy's
``kv_transfer_params``): :mod:`.handoff`. A decoder told where to pull from answers
``None`` (vLLM asks again next step) until its workers' pulls have ended, then looks up.

Which saves a step carries (plain chunks; a hybrid model's checkpoints, :mod:`.checkpoints`;
a state model's PD prefiller's hit sent from kvtier's copy; an ended request's answer) and
how far a request is looked up are :mod:`.step_saves`'s rules.

The answer a request generated (``save_decode_cache``): a chat's next turn sends it back as
part of its prompt, so when a request ends, the whole chunks of prompt + output that hold KV
and are not stored yet are saved too. vLLM keeps the request's blocks until the workers say
the copy is done (``request_finished`` answers "delay the free"; the next step's metadata
carries the save and names the request in ``finishing``; each worker reports it in
``finished_sending`` once that step's saves are copied, whether or not it stored them)::

    prompt + output  |====c0====|====c1====|==c2 (output)==|--partial--|x   x: sampled, no KV
    saved at prefill  c0, c1                                              (prompt's whole chunks)
    saved at the end                       c2                             then the blocks go

Saves that land after the step (``async_saves``: a GPU's copies, which the workers wait for
behind the step, :mod:`.save_drain`): ``request_finished`` also delays the free of a request
with any save sent, names it in the next step's ``finishing``, and each worker reports it
once none of its saves is still copying. So vLLM frees or reuses no block of it, and hears
of no finished send, before the copies out of its blocks landed::

    step n    wait_for_save: gather, queue the copies, return      (copies in flight)
    end       request_finished -> (True, ...)                      (vLLM keeps the blocks)
    step n+1  finishing = [rid]; get_finished: rid only once its copies landed -> blocks go

Ending a request: :meth:`finished` sends ``end`` to every worker at once, so a request
aborted while the engine is idle releases its pins now, not at the next step. A preempted
request keeps its lease (the pinned chunks are exactly what it reloads when it resumes) and
ends like any other request: once, when vLLM finishes it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvtier.errors import KVTierError
from kvtier.hit import Hit
from kvtier.integrations.vllm.extra_keys import RequestKeyer
from kvtier.integrations.vllm.handoff import Handoff
from kvtier.integrations.vllm.metadata import KVTierMetadata, LoadSpec, SaveSpec
from kvtier.integrations.vllm.request_state import RequestState, copy_tables, set_tables
from kvtier.integrations.vllm.rpc import LookupClient
from kvtier.integrations.vllm.step_saves import StepSaves
from kvtier.repeated_log import RepeatedLog
from kvtier.request_salt import RequestSalt

log = logging.getLogger(__name__)


class SchedulerSide:
    """Scheduler-side state of one vLLM instance. ``loads``/``saves`` follow the kv_role:
    kv_both does both, a producer only saves, a consumer only loads."""

    def __init__(
        self,
        clients: list[LookupClient],
        *,
        block_size: int,
        chunk_size: int,
        loads: bool,
        saves: bool,
        async_lower_loads: bool = True,
        all_async: bool = False,
        pd_sender: str | None = None,
        state_chunks: bool = False,
        save_decode: bool = False,
        checkpoint_unit: int = 0,
        async_saves: bool = False,
    ) -> None:
        """``all_async``: every load in the background, also from the CPU tier (a model with
        several KV-cache groups: vLLM takes load failures only per request, from async
        loads). ``pd_sender``: a PD prefiller's engine id (its transfer ids start with it);
        None on a decoder or without PD. ``state_chunks``: the model has a state group (hits
        and saves in whole chunks that end where a prefill step ended). ``save_decode``: store
        the generated tokens' whole chunks when a request ends (see the module docstring).
        ``checkpoint_unit``: a sliding-window model's block unit when it saves its prompts'
        checkpoints (:mod:`.checkpoints`; 0: it does not). Which saves a step carries is
        :mod:`.step_saves`'s. ``async_saves``: the workers' saves land after the step (a
        GPU's copies, :mod:`.save_drain`): vLLM keeps an ended request's blocks until its
        workers report every save of it landed (the module docstring)."""
        self.clients = clients
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.loads = loads
        self.saves = saves
        self.async_lower_loads = async_lower_loads
        self.all_async = all_async
        self.pd_sender = pd_sender
        self.state_chunks = state_chunks
        self._saves = StepSaves(
            block_size=block_size,
            chunk_size=chunk_size,
            saves=saves,
            pd_sender=pd_sender,
            state_chunks=state_chunks,
            save_decode=save_decode,
            checkpoint_unit=checkpoint_unit,
        )
        self._finishing: list[SaveSpec] = []  # decode saves of ended requests, next step
        self._ending: list[str] = []  # ended requests vLLM keeps: the next step's finishing
        self.async_saves = async_saves
        self._saving: set[str] = set()  # with async_saves: requests with a save sent
        # Hits are usable in whole blocks (a state model's end at chunk ends or at its
        # prompt's checkpoint, block boundaries where its states are).
        self.block_size = block_size
        self._requests: dict[str, RequestState] = {}
        self._keyer = RequestKeyer(chunk_size)
        self.uncached = 0  # requests not cached: something in them kvtier cannot key
        self._async_loads: list[LoadSpec] = []  # for requests vLLM does not schedule yet
        self._complaints = RepeatedLog(log)  # a worker down fails every call: log it once
        self._handoff = Handoff(
            clients, pd_sender=pd_sender, loads=loads, complaints=self._complaints
        )

    # -- vLLM's scheduler hooks ------------------------------------------------------------
    def num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens kvtier can add beyond ``num_computed_tokens`` (whole blocks), and whether
        they load asynchronously (some come from disk or Redis); None while a PD decoder's
        pull runs (vLLM asks again next step)."""
        rid = request.request_id
        state = self._state_of(request)
        if state.transfer_id is None:
            params = getattr(request, "kv_transfer_params", None)
            state.transfer_id, state.source = self._handoff.transfer(params)
            state.pull_since = time.monotonic()
        state.local = num_computed_tokens
        if not self.loads or len(state.tokens) < 2 or state.uncached is not None:
            return 0, False
        looked_up = self._saves.lookup_tokens(state)
        if state.hit is None and state.source is not None and state.transfer_id is not None:
            args = (looked_up, state.salt, state.source, state.pull_since)
            if not self._handoff.pulled(state.transfer_id, *args):
                return None, False
            state.source = None  # pulled, or given up: look up whatever arrived
        if state.hit is None:
            state.hit = self._lookup(rid, looked_up, state.salt)
            if state.transfer_id is None or not self.saves:
                # Chunks kvtier holds need no save; a prefiller still sends them all.
                held = state.hit.tokens // self.chunk_size * self.chunk_size
                state.saved = max(state.saved, held)
        last = len(state.tokens) - 1
        usable = min(state.hit.tokens, last) // self.block_size * self.block_size
        in_cpu = min(state.hit.cpu_tokens, last) // self.block_size * self.block_size
        new = max(0, usable - num_computed_tokens)
        state.load_async = new > 0 and (
            self.all_async or (self.async_lower_loads and usable > max(in_cpu, num_computed_tokens))
        )
        return new, state.load_async

    def after_alloc(
        self,
        request: Any,
        block_ids: list[int],
        num_external_tokens: int,
        tables: tuple[list[int], ...] = (),
    ) -> None:
        """``tables``: every KV-cache group's block table when there are several."""
        state = self._state_of(request)
        state.block_ids = list(block_ids)
        set_tables(state, tables)
        if num_external_tokens <= 0:
            return
        start, end = state.local, state.local + num_external_tokens
        if state.load_async:
            # vLLM schedules the request only after the load: send it with the next step.
            spec = LoadSpec(
                request.request_id,
                state.tokens,
                state.block_ids[:],
                start,
                end,
                True,
                state.salt,
                copy_tables(state),
            )
            self._async_loads.append(spec)
        else:
            state.load = (start, end)

    def build_meta(self, out: Any) -> KVTierMetadata:
        """Loads and saves for the step vLLM just scheduled (``out``: SchedulerOutput)."""
        meta = KVTierMetadata(loads=self._async_loads, saves=self._finishing)
        meta.finishing = self._ending
        self._async_loads, self._finishing, self._ending = [], [], []
        for rid in out.preempted_req_ids or ():
            state = self._requests.get(rid)
            if state is not None:  # its blocks are gone; new ones come when it resumes
                state.block_ids, state.load = [], None
                set_tables(state, ())
        for new in out.scheduled_new_reqs:
            state = self._state(new)
            state.block_ids = list(new.block_ids[0])
            set_tables(state, new.block_ids)
            done = new.num_computed_tokens + out.num_scheduled_tokens[new.req_id]
            self._add_specs(meta, new.req_id, state, done)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self._requests.get(rid)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
                set_tables(state, new_ids or ())
            elif new_ids:
                state.block_ids.extend(new_ids[0])  # also tables[0], the same list
                for table, more in zip(state.tables[1:], new_ids[1:], strict=False):
                    table.extend(more)
            done = cached.num_computed_tokens[i] + out.num_scheduled_tokens[rid]
            self._add_specs(meta, rid, state, done)
        if self.async_saves:  # a PD prefiller's saves land in the step (the worker's .save);
            # an ended request's answer is in ``finishing`` already
            self._saving.update(
                s.request_id
                for s in meta.saves
                if s.transfer_id is None and s.request_id in self._requests
            )
        return meta

    def short_loads(self, short: dict[str, int]) -> None:
        """Loads that delivered fewer tokens than planned (a chunk failed its checksum or
        vanished, a tier went down, no page to load into): vLLM recomputes from there, and
        the chunks it recomputes must be saved again, since the tier dropped its bad copy.

        The request's hit ends where its load did: when vLLM reschedules it (its own prefix
        cache off, it asks again from token 0), kvtier never offers the failed chunks again,
        so a load that fails can neither repeat nor wedge the request."""
        for rid, loaded in short.items():
            state = self._requests.get(rid)
            if state is not None:
                state.saved = min(state.saved, loaded // self.chunk_size * self.chunk_size)
                state.checkpoint_saved = False  # if saved in that step, it was not
                if state.hit is not None and loaded < state.hit.tokens:
                    # Never offer again what failed to load (a request whose load failed as
                    # a whole, with several KV-cache groups, is asked again from scratch).
                    state.hit = Hit(loaded, min(state.hit.cpu_tokens, loaded))

    def finished(self, request_id: str, params: Any = None) -> dict[str, Any] | None:
        """The request ended, however: release what its lookup pinned, in every worker.
        ``params``: its ``kv_transfer_params``. Returns what a PD prefiller's answer carries
        for the decode request (vLLM puts it in the HTTP response), else None.

        A decode request that vLLM's API server refused before the engine took it arrives
        here already ended, with no state: its transfer (named in ``params``) is freed now,
        not ``pd_reservation_ttl_sec`` later."""
        state = self._requests.pop(request_id, None)
        self._saving.discard(request_id)  # save_output, called first, has read it
        if state is None:
            transfer = self._handoff.transfer(params)[0] if self.pd_sender is None else None
            ending = [transfer] if transfer is not None else []
        else:
            ending = [request_id] if state.hit is not None else []  # else: nothing pinned
            if state.transfer_id is not None and self.pd_sender is None:
                ending.append(state.transfer_id)  # a decoder: the PD reservation's lease
        self._end(ending)
        if state is None or state.transfer_id is None or self.pd_sender is None:
            return None
        return self._handoff.answer(state.transfer_id)

    def save_output(self, request: Any, tables: Any) -> bool:
        """Before :meth:`finished`: queue the ending request's unsaved whole chunks of
        prompt + output for the next step (``tables``: every KV-cache group's blocks of its
        computed tokens). True if vLLM must keep the blocks until the workers report the
        request (``finished_sending``): a save was queued now, or (``async_saves``) one sent
        before may still be copying out of them (see the module docstring)."""
        rid = request.request_id
        state = self._requests.get(rid)
        spec = self._saves.output(request, state, tables) if state is not None else None
        if spec is not None:
            self._finishing.append(spec)
        keep = spec is not None or rid in self._saving
        self._saving.discard(rid)
        if keep:
            self._ending.append(rid)
        return keep

    def _end(self, ending: list[str]) -> None:
        for rid in ending:
            for client in self.clients:
                try:
                    client.end(rid)
                except KVTierError as exc:
                    # The worker is gone or stuck; its Engine ends every lease when it closes.
                    self._complaints.warning(
                        ("end", client.path), "kvtier: could not end request %s: %s", rid, exc
                    )

    def reset(self) -> bool:
        """Clear every worker's tiers (pinned entries stay). False if a worker failed."""
        ok = True
        for client in self.clients:
            try:
                client.clear()
            except KVTierError as exc:
                log.warning("kvtier: reset failed: %s", exc)
                ok = False
        return ok

    def close(self) -> None:
        for client in self.clients:
            client.close()

    # -- helpers ---------------------------------------------------------------------------
    def _state_of(self, request: Any) -> RequestState:
        """The request's state; made by its first hook, which is the one that sees vLLM's
        whole Request (``get_num_new_matched_tokens``, ``update_state_after_alloc``): the
        tokens and everything else that keys its KV."""
        state = self._requests.get(request.request_id)
        if state is None:
            keyed = self._keyer.key(request)
            if keyed.uncached is not None:
                self.uncached += 1
                self._complaints.warning(
                    ("uncached", keyed.uncached),
                    "kvtier: request %s is not cached: %s (vLLM serves it as usual)",
                    request.request_id,
                    keyed.uncached,
                )
            state = RequestState(tokens=keyed.tokens, salt=keyed.salt, uncached=keyed.uncached)
            self._requests[request.request_id] = state
        return state

    def _state(self, new: Any) -> RequestState:
        """The state a hook above made for a newly scheduled request (``new``: vLLM's
        NewRequestData). One no hook saw is keyed by its tokens alone, so it is not cached
        if it carries anything else (fail closed: its salt is not in NewRequestData)."""
        state = self._requests.get(new.req_id)
        if state is None:
            extra = any(
                getattr(new, name, None) is not None and getattr(new, name, None) != []
                for name in ("lora_request", "mm_features", "prompt_embeds")
            )
            why = "not seen at lookup, and it carries extra keys" if extra else None
            state = RequestState(tokens=list(new.prompt_token_ids or ()), uncached=why)
            self._requests[new.req_id] = state
        return state

    def _lookup(self, rid: str, tokens: list[int], salt: RequestSalt | None) -> Hit:
        """The hit (and of it, in CPU) that every worker holds (the smallest); a worker that
        fails means no hit."""
        hits: list[Hit] = []
        for client in self.clients:
            try:
                hits.append(client.lookup(rid, tokens, salt))
            except KVTierError as exc:  # whatever the channel met: a miss, never an exception
                self._complaints.warning(
                    ("lookup", client.path),
                    "kvtier lookup for %s failed, treating as a miss: %s",
                    rid,
                    exc,
                )
                hits.append(Hit(0, 0))
        if len(hits) == 1:
            return hits[0]  # one worker (no tensor parallelism): its answer as it came
        if not hits:
            return Hit(0, 0)
        return Hit(min(h.tokens for h in hits), min(h.cpu_tokens for h in hits))

    def _add_specs(self, meta: KVTierMetadata, rid: str, state: RequestState, done: int) -> None:
        if state.load is not None:
            start, end = state.load
            meta.loads.append(
                LoadSpec(
                    rid,
                    state.tokens,
                    state.block_ids[:],
                    start,
                    end,
                    False,
                    state.salt,
                    copy_tables(state),
                )
            )
            state.load = None
        self._saves.add(meta, rid, state, done)
