"""One request solved alone, whole solves: ``StreamingCFM.forward_chunk`` then the docs/design.md §3 trim, the
loop the upstream runs per stream. The server tests compare every batched, ragged or spread-out
solve with it."""

from __future__ import annotations

import torch

from torch_cfm.models import trim_attention_cache


class Solo:
    """A request's prompt and chunks, one whole ``forward_chunk`` each, its caches kept and trimmed."""

    def __init__(self, cfm, spks, prompt_len):
        self.cfm, self.spks, self.prompt_len = cfm, spks, prompt_len
        self.cnn = self.att = None

    def chunk(self, mu, cond=None):
        cond = torch.zeros_like(mu) if cond is None else cond
        mel, self.cnn, att = self.cfm.forward_chunk(mu[None], self.spks[None], cond[None], self.cnn, self.att)
        self.att = trim_attention_cache(att, self.prompt_len)
        return mel[0]
