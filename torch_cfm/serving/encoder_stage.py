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

On CUDA each batch shape is replayed from a checked CUDA graph (:class:`~torch_cfm.graphs.GraphedCall`),
batches padded to the bucket sizes with copies of a row (rows never mix). The graphs' static caches
in and out share two buffers (``shared_io``): the largest batch's, not one copy per (batch, cache
length) key.
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

import torch
import torch.nn.functional as F

from ..buckets import CACHE_STEP, padded_count
from ..graphs import GraphedCall
from ..models.upstream import encoder_forward_chunk


class EncoderStage:
    """Batched chunk encoding over the user's flow (module docstring).

    Args:
        flow: the upstream ``CausalMaskedDiffWithXvec`` (its embedding, encoder, projection).
        batching: True (equal shapes batched), ``"ragged"`` (also unequal cache lengths) or False.
        batch_buckets: sorted batch sizes a batch is padded to (None: no padding).
        graphs: replay each batch shape from a CUDA graph.
        stats: the server's counters (``encoder_batches``, ``ragged_batches`` are incremented).
    """

    def __init__(self, flow, *, batching, batch_buckets: Optional[Sequence[int]], graphs: bool, stats: dict) -> None:
        self.flow, self.batching, self.batch_buckets = flow, batching, batch_buckets
        self.lookahead, self.up_rate = int(flow.pre_lookahead_len), int(flow.up_rate)
        param = next(flow.encoder.parameters())
        self.dtype, self.device, self.stats = param.dtype, param.device, stats
        self._forward_chunk = encoder_forward_chunk(flow.encoder)  # the eager method, never Dynamo's wrapper
        self.call, self.ragged_call = self._encode_group, self._ragged_group
        if graphs:
            budget = 8 * max(len(batch_buckets or [1]), 1)
            # shared_io: the (batch, cache length) keys' conformer caches in and out share two buffers
            self.call = GraphedCall(self._encode_group, name="Token2wavServer.encoder", max_graphs=budget,
                                    shared_io=True)
            self.ragged_call = GraphedCall(self._ragged_group, name="Token2wavServer.encoder_ragged",
                                           max_graphs=budget, shared_io=True)

    def autocast(self):
        """``Token2wav(float16=True)`` runs the flow (embedding, encoder, projections) under fp16
        autocast: a half-precision flow on CUDA runs the same way here."""
        half = self.dtype in (torch.float16, torch.bfloat16) and self.device.type == "cuda"
        return torch.autocast("cuda", dtype=self.dtype, enabled=half)

    def padded(self, count: int) -> int:
        """The batch size ``count`` rows are padded to (:func:`~torch_cfm.buckets.padded_count`)."""
        return padded_count(count, self.batch_buckets)

    def __call__(self, items) -> dict[Hashable, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``items``: (stream id, tokens (1, n), conformer cnn cache or None, att cache or None, last).
        Returns {stream id: (mu (80, T), new cnn cache, new att cache)} (caches untrimmed, each
        stream's own tensors)."""
        groups: dict[tuple, list] = {}
        for i, (sid, tokens, cnn, att, last) in enumerate(items):
            ragged = self.batching == "ragged" and att is not None
            key = (tokens.shape[1], None if att is None else ("ragged" if ragged else att.shape[3]), last)
            if not self.batching:
                key = key + (i,)
            groups.setdefault(key, []).append((sid, tokens, cnn, att, last))
        out = {}
        for key, members in groups.items():
            self.stats["encoder_batches"] += 1
            if key[1] == "ragged" and len({m[3].shape[3] for m in members}) > 1:
                self.stats["ragged_batches"] += 1
                out.update(self._encode_ragged(members))
            else:
                out.update(self._encode_equal(members))
        return out

    def _encode_equal(self, members) -> dict:
        last = members[0][4]
        rows = members + [members[0]] * (self.padded(len(members)) - len(members))
        tokens = torch.cat([m[1] for m in rows], dim=0)
        cnn = None if members[0][2] is None else torch.cat([m[2] for m in rows], dim=0)
        att = None if members[0][3] is None else torch.cat([m[3] for m in rows], dim=1)
        with self.autocast():
            h, new_cnn, new_att = self.call(tokens, cnn, att, last)
        whole = len(rows) == 1  # else each stream's caches are copied out of the batch tensors, so
        out = {}
        for b, (sid, *_rest) in enumerate(members):  # that a stream holds its own bytes only
            cnn_b, att_b = new_cnn[b:b + 1], new_att[:, b:b + 1]
            out[sid] = (h[b].transpose(0, 1), cnn_b if whole else cnn_b.clone(), att_b if whole else att_b.clone())
        return out

    def _encode_ragged(self, members) -> dict:
        """One batch of streams whose conformer caches differ in length: each layer's cache
        left-padded to the group's bucketed length Lb (zeros), the padding masked out of every
        attention (``mask`` = keys to attend), the new caches cut back to each stream's own frames
        in the upstream layout."""
        n1 = len(self.flow.encoder.encoders)
        last = members[0][4]
        lengths = [m[3].shape[3] for m in members]
        lb = max(lengths)
        lb = -(-lb // CACHE_STEP) * CACHE_STEP if self.batch_buckets else lb
        lb += lb % 2
        pad = self.padded(len(members)) - len(members)
        rows = members + [members[0]] * pad
        lengths = lengths + [lengths[0]] * pad
        first, up = [], []
        for (_, _, _, att, _), length in zip(rows, lengths):
            first.append(F.pad(att[:n1, :, :, :length // 2], (0, 0, lb // 2 - length // 2, 0)))
            up.append(F.pad(att[n1:], (0, 0, lb - length, 0)))
        att1, att2 = torch.cat(first, dim=1), torch.cat(up, dim=1)
        tokens = torch.cat([m[1] for m in rows], dim=0)
        cnn = torch.cat([m[2] for m in rows], dim=0)
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
            out[sid] = (h[b].transpose(0, 1), cnn_new[b:b + 1].clone(), torch.cat([a1.repeat(1, 1, 1, 2, 1), a2], dim=0))
        return out

    def _ragged_group(self, tokens, cnn, att1, att2, mask1, mask2, last: bool):
        """The flow's chunk encoder over left-padded caches with key masks (the upstream
        modules, driven in ``UpsampleConformerEncoderV2.forward_chunk``'s order)."""
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
        return flow.encoder_proj(xs), torch.cat([cnn1, cnn2], dim=2), torch.stack(new1), torch.stack(new2)

    def _encode_group(self, tokens, cnn, att, last: bool):
        """The flow's chunk encoder over one batch: embedding, conformer chunk, projection."""
        flow = self.flow
        h, new_cnn, new_att = self._forward_chunk(flow.input_embedding(tokens), last_chunk=last, cnn_cache=cnn,
                                                  att_cache=att)
        return flow.encoder_proj(h), new_cnn, new_att

    def graph_counts(self) -> dict[str, int]:
        return {"encoder": sum(getattr(c, "graph_count", 0) for c in (self.call, self.ragged_call))}


__all__ = ["EncoderStage"]
