"""The token encoder stage of :class:`~torch_cfm.serving.Token2wavServer`: tokens → mu per stream.

The flow's own ``input_embedding``, ``encoder.forward_chunk`` (the upstream
``UpsampleConformerEncoderV2`` with its conformer conv and attention caches) and ``encoder_proj``,
batched across streams:

* streams whose chunk has the same token count, conformer cache length and last flag run as one
  batch through the upstream ``forward_chunk`` itself (its chunk path has no padding masks);
* with ``ragged`` batching, streams whose cache lengths differ (other prompt lengths, or in their
  first chunks next to settled streams) also share a batch: each cache is left-padded to a common,
  bucketed length and the padding masked out of every attention, the upstream modules driven in
  ``forward_chunk``'s order. A real key's distance to each query, hence its relative position
  encoding, does not change with left padding, so each stream gets its own result.

The stage holds every open stream's conformer caches in slots (:class:`ConformerSlots`), trimmed
as ``Token2wav.stream`` trims them. On CUDA each batch shape is replayed from a CUDA graph
(:class:`~torch_cfm.graphs.GraphedCall`), batches padded to the bucket sizes (rows never mix):

* an equal batch (same token count, cache length, prompt length and last flag) is one in-place
  graph: its caches gathered out of the slots, the chunk encoder, the new caches trimmed and
  scattered back, mu written to one preallocated buffer (then copied out). Padding rows read a
  real row's caches and write to the slots' spare row;
* a ragged batch is a checked graph over caches gathered and padded on the host, whose static
  caches in and out share two buffers (``shared_io``); each stream's new caches are trimmed into
  its slot after it.

Inside both, the conformer's attention runs as :func:`~torch_cfm.models.conformer_attention.rel_pos_attention`
(the same function with each layer's new cache written in one copy, not three concatenations).
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

import torch
import torch.nn.functional as F

from ..buckets import CACHE_STEP, padded_count
from ..graphs import GraphedCall
from ..errors import fail
from ..models.cache import TRIM_KEEP_OLDEST
from ..models.conformer_attention import encoder_attention, one_copy_attention
from ..models.upstream import encoder_forward_chunk
from .conformer_slots import ConformerSlots


class EncoderStage:
    """Batched chunk encoding over the user's flow (module docstring).

    Args:
        flow: the upstream ``CausalMaskedDiffWithXvec`` (its embedding, encoder, projection).
        batching: True (equal shapes batched), ``"ragged"`` (also unequal cache lengths) or False.
        batch_buckets: sorted batch sizes a batch is padded to (None: no padding).
        graphs: replay each batch shape from a CUDA graph.
        stats: the server's counters (``encoder_batches``, ``ragged_batches`` are incremented).
        max_streams, max_prompt_frames, max_chunk_tokens: the slots held, the longest prompt (mel
            frames) and the longest chunk (tokens, lookahead included).
        causal: trim as minicpmo-utils' ``Token2wav.stream`` does (the token-rate layers at the token
            rate); else as stepaudio2-minicpmo's.
    """

    def __init__(self, flow, *, batching, batch_buckets: Optional[Sequence[int]], graphs: bool, stats: dict,
                 max_streams: int, max_prompt_frames: int, max_chunk_tokens: int, causal: bool = False) -> None:
        self.flow, self.batching, self.batch_buckets, self.causal = flow, batching, batch_buckets, causal
        self._prompt: dict[Hashable, int] = {}
        self.lookahead, self.up_rate = int(flow.pre_lookahead_len), int(flow.up_rate)
        param = next(flow.encoder.parameters())
        self.dtype, self.device, self.stats = param.dtype, param.device, stats
        enc = flow.encoder
        attn = enc.encoders[0].self_attn
        self._forward_chunk = encoder_forward_chunk(flow.encoder)  # the eager method, never Dynamo's wrapper
        self._attention = encoder_attention(flow.encoder)  # run as rel_pos_attention inside the stage's calls
        self._n1 = len(enc.encoders)  # the token-rate layers (their packed caches hold their frames twice)
        self.slots = ConformerSlots(max_streams, max_prompt_frames + TRIM_KEEP_OLDEST,
                                    (len(enc.encoders) + len(enc.up_encoders), attn.h, 2 * attn.d_k),
                                    (enc.output_size(), 2 + 2 * int(enc.up_layer.stride)), self._cache_dtypes(),
                                    param.device)
        frames = max(max_prompt_frames, max_chunk_tokens * self.up_rate)  # the in-place graphs' mu output
        self._mu = torch.empty(self.padded(max_streams), frames, flow.output_size, dtype=param.dtype, device=param.device)
        self.call, self.ragged_call = self._encode_slots, self._ragged_group
        if graphs:
            budget = 8 * max(len(batch_buckets or [1]), 1)
            self.call = GraphedCall(self._encode_slots, name="Token2wavServer.encoder", max_graphs=budget,
                                    in_place=True)
            # shared_io: the (batch, cache length) keys' conformer caches in and out share two buffers
            self.ragged_call = GraphedCall(self._ragged_group, name="Token2wavServer.encoder_ragged",
                                           max_graphs=budget, shared_io=True)

    def autocast(self):
        """``Token2wav(float16=True)`` runs the flow (embedding, encoder, projections) under fp16
        autocast: a half-precision flow on CUDA runs the same way here."""
        half = self.dtype in (torch.float16, torch.bfloat16) and self.device.type == "cuda"
        return torch.autocast("cuda", dtype=self.dtype, enabled=half)

    def _cache_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """(cnn, att) dtypes of the chunk encoder's caches as this stage runs it (one probe chunk:
        under autocast the conv caches come out float32, the attention caches in 16 bits)."""
        tokens = torch.zeros(1, self.lookahead + 2, dtype=torch.long, device=self.device)
        with torch.inference_mode(False), torch.no_grad(), self.autocast():
            _, cnn, att = self._forward_chunk(self.flow.input_embedding(tokens), last_chunk=False)
        return cnn.dtype, att.dtype

    def padded(self, count: int) -> int:
        """The batch size ``count`` rows are padded to (:func:`~torch_cfm.buckets.padded_count`)."""
        return padded_count(count, self.batch_buckets)

    # ------------------------------------------------------------------ streams
    def open(self, sid: Hashable, prompt_frames: int) -> None:
        """A slot for ``sid``, empty until its prompt is encoded or :meth:`adopt` fills it."""
        self.slots.open(sid)
        self._prompt[sid] = int(prompt_frames)

    def adopt(self, sid: Hashable, cnn: torch.Tensor, att: torch.Tensor) -> None:
        """Copies of caches (another stream's, a cached voice's) into ``sid``'s slot."""
        self.slots.write([sid], cnn, att)

    def close(self, sid: Hashable) -> None:
        self.slots.close(sid)
        del self._prompt[sid]

    def caches(self, sid: Hashable) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(cnn (1, C, k), att (depth, 1, H, L, 2·d_k)): views of ``sid``'s slot, trimmed (None, None
        before its prompt is encoded)."""
        return self.slots.caches(sid)

    def trim_pieces(self, frames: int, prompt: int) -> list[tuple[slice, int, int, int]]:
        """``Token2wav.stream``'s conformer-cache trim of a packed (depth, B, H, ``frames``, 2·d_k)
        cache to the prompt and the last 100 frames, as copies (layers, to frame, from frame,
        frames): the stepaudio2-minicpmo rule over the packed cache, or minicpmo-utils' (``causal``),
        which trims the token-rate layers at the token rate and repacks them (twice over)."""
        every = slice(None)
        if frames <= prompt + TRIM_KEEP_OLDEST:
            return [(every, 0, 0, frames)]
        if not self.causal:
            return [(every, 0, 0, prompt), (every, prompt, frames - TRIM_KEEP_OLDEST, TRIM_KEEP_OLDEST)]
        tokens, p2, k2 = frames // 2, prompt // 2, TRIM_KEEP_OLDEST // 2
        kept = [(0, tokens)] if tokens <= p2 + k2 else [(0, p2), (tokens - k2, k2)]
        size, token_layers = sum(n for _, n in kept), slice(0, self._n1)
        out, at = [], 0
        for src, n in kept * 2:  # the token-rate frames, then the packed copy of them
            out.append((token_layers, at, src, n))
            at += n
        rest = slice(self._n1, None)
        if 2 * size != prompt + TRIM_KEEP_OLDEST:
            fail("EncoderStage.trim", "prompt", "be even (the packed token-rate cache holds it halved)", str(prompt))
        return out + [(rest, 0, 0, prompt), (rest, prompt, frames - TRIM_KEEP_OLDEST, TRIM_KEEP_OLDEST)]

    def changed_pieces(self, pieces: list[tuple[slice, int, int, int]], length: int,
                       depth: int) -> list[tuple[slice, int, int, int]]:
        """``pieces`` (:meth:`trim_pieces` of a packed cache grown from ``length`` gathered frames) less
        the frames they would write back unchanged into the slot they were gathered from: a copy to
        frame ``to`` from packed frame ``src == to`` below the gathered frames (the token-rate layers'
        first ``length // 2``, the others' first ``length``: :meth:`_packed_chunk`). In a steady tick
        that is the prompt's frames: every layer rewrote them before. Valid only where each row's
        destination slot is its source (the dump slot of padding rows may keep stale frames)."""
        out = []
        for layers, to, src, n in pieces:
            lo, hi, _ = layers.indices(depth)
            for g_lo, g_hi, gathered in ((0, self._n1, length // 2), (self._n1, depth, length)):
                a, b = max(lo, g_lo), min(hi, g_hi)
                if a >= b:
                    continue
                skip = min(n, gathered - src) if to == src and src < gathered else 0
                if n > skip:
                    out.append((slice(a, b), to + skip, src + skip, n - skip))
        return out

    def trim(self, att: torch.Tensor, prompt: int) -> torch.Tensor:
        """A batch's packed cache (depth, B, H, L, 2·d_k) trimmed (:meth:`trim_pieces`): ``att``
        itself when nothing is cut, else a new tensor."""
        pieces = self.trim_pieces(att.shape[3], prompt)
        if len(pieces) == 1:
            return att
        out = att.new_empty(*att.shape[:3], prompt + TRIM_KEEP_OLDEST, att.shape[4])
        for layers, to, src, n in pieces:
            out[layers, :, :, to:to + n] = att[layers, :, :, src:src + n]
        return out

    # ------------------------------------------------------------------ ticks
    def __call__(self, items) -> dict[Hashable, torch.Tensor]:
        """``items``: (stream id, tokens (1, n), last) of open streams. Encodes each, updates its
        slot's caches (trimmed) and returns {stream id: mu (80, T)}."""
        groups: dict[tuple, list] = {}
        for i, (sid, tokens, last) in enumerate(items):
            length = self.slots.length(sid)
            ragged = self.batching == "ragged" and length > 0
            key = (tokens.shape[1], None if length == 0 else ("ragged" if ragged else (length, self._prompt[sid])),
                   last)
            if not self.batching:
                key = key + (i,)
            groups.setdefault(key, []).append((sid, tokens, last))
        out = {}
        for key, members in groups.items():
            self.stats["encoder_batches"] += 1
            if key[1] == "ragged" and len({self.slots.length(m[0]) for m in members}) > 1:
                self.stats["ragged_batches"] += 1
                out.update(self._encode_ragged(members))
            else:
                out.update(self._encode_equal(members))
        return out

    def _tokens(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """A group's token rows (each (1, n), any integer dtype, any device) as one (rows, n) int64
        tensor on the stage's device: one concatenation and one conversion a group, not one per
        stream, and one dtype for the graph key whatever callers pass."""
        if len({t.device for t in parts}) > 1:
            parts = [t.to(self.device) for t in parts]
        return torch.cat(parts, dim=0).to(device=self.device, dtype=torch.int64)

    def _encode_equal(self, members) -> dict:
        """One batch of equal shapes and prompt lengths through the in-place graph of its key."""
        sids, last = [m[0] for m in members], members[0][2]
        n, rows = len(sids), self.padded(len(sids))
        tokens = self._tokens([m[1] for m in members] + [members[0][1]] * (rows - n))
        length, prompt = self.slots.length(sids[0]), self._prompt[sids[0]]
        source, dest = self.slots.index(sids + [sids[0]] * (rows - n)), self.slots.index(sids, rows)
        with self.autocast():
            self.call(tokens, source, dest, length, prompt, last)
        frames = (tokens.shape[1] - (0 if last else self.lookahead)) * self.up_rate
        new = length + frames
        self.slots.set_length(sids, new if new <= prompt + TRIM_KEEP_OLDEST else prompt + TRIM_KEEP_OLDEST)
        mu = self._mu[:n, :frames].clone()  # the buffer is every key's
        return {sid: mu[b].transpose(0, 1) for b, sid in enumerate(sids)}

    def _encode_slots(self, tokens, source, dest, length: int, prompt: int, last: bool) -> None:
        """The in-place body of an equal batch: caches of slots ``source`` (``length`` frames; none
        when 0) through the flow's chunk encoder; mu (B, T, 80) into the stage's buffer, the new
        caches trimmed to ``prompt`` into slots ``dest``."""
        flow = self.flow
        if length == 0:
            with one_copy_attention(self._attention):
                h, new_cnn, new_att = self._forward_chunk(flow.input_embedding(tokens), last_chunk=last)
            mu = flow.encoder_proj(h)
        else:
            mu, new_cnn, new_att = self._packed_chunk(tokens, source, length, last)
        self._mu[:mu.shape[0], :mu.shape[1]].copy_(mu)
        pieces = self.trim_pieces(new_att.shape[3], prompt)
        self.slots.scatter(dest, new_cnn, new_att, self.changed_pieces(pieces, length, new_att.shape[0]))

    def _encode_ragged(self, members) -> dict:
        """One batch of streams whose conformer caches differ in length: each layer's cache
        left-padded to the group's bucketed length Lb (zeros), the padding masked out of every
        attention (``mask`` = keys to attend), the new caches cut back to each stream's own frames
        in the upstream layout."""
        n1 = len(self.flow.encoder.encoders)
        last = members[0][2]
        caches = [self.slots.caches(m[0]) for m in members]
        lengths = [att.shape[3] for _, att in caches]
        lb = max(lengths)
        lb = -(-lb // CACHE_STEP) * CACHE_STEP if self.batch_buckets else lb
        lb += lb % 2
        pad = self.padded(len(members)) - len(members)
        rows = members + [members[0]] * pad
        caches = caches + [caches[0]] * pad
        lengths = lengths + [lengths[0]] * pad
        first, up = [], []
        for (_, att), length in zip(caches, lengths):
            first.append(F.pad(att[:n1, :, :, :length // 2], (0, 0, lb // 2 - length // 2, 0)))
            up.append(F.pad(att[n1:], (0, 0, lb - length, 0)))
        att1, att2 = torch.cat(first, dim=1), torch.cat(up, dim=1)
        tokens = self._tokens([m[1] for m in rows])
        cnn = torch.cat([c for c, _ in caches], dim=0)
        t1 = tokens.shape[1] - (0 if last else self.lookahead)
        t2 = t1 * self.up_rate
        dev = tokens.device
        keys1, keys2 = torch.arange(lb // 2 + t1, device=dev), torch.arange(lb + t2, device=dev)
        half = torch.tensor([lb // 2 - n // 2 for n in lengths], device=dev)
        full = torch.tensor([lb - n for n in lengths], device=dev)
        mask1 = (keys1[None, :] >= half[:, None])[:, None, :].expand(-1, t1, -1)
        mask2 = (keys2[None, :] >= full[:, None])[:, None, :].expand(-1, t2, -1)
        with self.autocast():
            h, cnn_new, new1, new2 = self.ragged_call(tokens, cnn, att1, att2, mask1.contiguous(), mask2.contiguous(),
                                                      last)
        out = {}
        for b, ((sid, *_), length) in enumerate(zip(members, lengths)):
            a1 = new1[:, b:b + 1, :, lb // 2 - length // 2:]
            a2 = new2[:, b:b + 1, :, lb - length:]
            att = torch.cat([a1.repeat(1, 1, 1, 2, 1), a2], dim=0)
            self.slots.write([sid], cnn_new[b:b + 1], self.trim(att, self._prompt[sid]))
            out[sid] = h[b].transpose(0, 1)
        return out

    def _packed_chunk(self, tokens, source, length: int, last: bool):
        """An equal batch's chunk through the upstream layers (:meth:`_layers`) over one packed
        (depth, B, H, L, 2·d_k) tensor in ``forward_chunk``'s layout (the token-rate layers' frames,
        then a copy of them): the slots' caches gathered into its first ``length`` frames, each
        layer's new frames written after them in place (so no cache is copied again), then the
        token-rate layers' copy. Replaces a gather, three concatenations per layer and the stack,
        repeat and concatenation of the new caches. Returns (mu (B, T, 80), cnn cache, packed)."""
        n1 = self._n1
        frames = (tokens.shape[1] - (0 if last else self.lookahead)) * self.up_rate
        packed, cnn = self.slots.gather_packed(source, length, length + frames, n1)

        def into(i, shape, dtype, device):
            if dtype != packed.dtype:
                fail("EncoderStage", "the encoder's attention caches", f"be {packed.dtype}", str(dtype))
            return packed[i, :, :, :shape[2]]

        none = torch.zeros((0, 0, 0))  # forward_chunk's "no mask"
        att1, att2 = packed[:n1, :, :, :length // 2], packed[n1:, :, :, :length]
        with one_copy_attention(self._attention, into):
            mu, cnn_new, _, _ = self._layers(tokens, cnn, att1, att2, none, none, last, stack=False)
        half = packed.shape[3] // 2
        packed[:n1, :, :, half:].copy_(packed[:n1, :, :, :half])
        return mu, cnn_new, packed

    def _ragged_group(self, tokens, cnn, att1, att2, mask1, mask2, last: bool):
        """The flow's chunk encoder over left-padded caches with key masks (:meth:`_layers`)."""
        with one_copy_attention(self._attention):
            return self._layers(tokens, cnn, att1, att2, mask1, mask2, last)

    def _layers(self, tokens, cnn, att1, att2, mask1, mask2, last: bool, stack: bool = True):
        """The upstream modules driven in ``UpsampleConformerEncoderV2.forward_chunk``'s order over
        caches att1 (token-rate layers) and att2 (mel-rate layers), with key masks (or (0, 0, 0)).
        Returns (mu, cnn cache, the layers' stacked new att caches or, with ``stack=False``, None)."""
        flow, enc = self.flow, self.flow.encoder
        xs, _, _ = enc.embed(flow.input_embedding(tokens), None)
        if last:
            xs = F.pad(xs, (0, 0, 0, enc.pre_lookahead_layer.pre_lookahead_len))
        xs, cnn1 = enc.pre_lookahead_layer.forward_chunk(xs, cache=cnn[:, :, :2])
        pos = enc.embed.position_encoding(offset=None, size=att1.shape[3] + xs.shape[1])
        new1 = []
        for i, layer in enumerate(enc.encoders):
            xs, _, cache, _ = layer(xs, mask1, pos, att_cache=att1[i])
            new1.append(cache)
        xs, _, cnn2 = enc.up_layer.forward_chunk(xs.transpose(1, 2).contiguous(), None, cache=cnn[:, :, 2:])
        xs, _, _ = enc.up_embed(xs.transpose(1, 2).contiguous(), None)
        pos = enc.embed.position_encoding(offset=None, size=att2.shape[3] + xs.shape[1])
        new2 = []
        for i, layer in enumerate(enc.up_encoders):
            xs, _, cache, _ = layer(xs, mask2, pos, att_cache=att2[i])
            new2.append(cache)
        if enc.normalize_before:
            xs = enc.after_norm(xs)
        cnn_new = torch.cat([cnn1, cnn2], dim=2)
        if not stack:
            return flow.encoder_proj(xs), cnn_new, None, None
        return flow.encoder_proj(xs), cnn_new, torch.stack(new1), torch.stack(new2)

    def graph_counts(self) -> dict[str, int]:
        return {"encoder": sum(getattr(c, "graph_count", 0) for c in (self.call, self.ragged_call))}


__all__ = ["EncoderStage"]
