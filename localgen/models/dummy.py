"""Dummy weights of a real architecture's shapes, for throughput work on models not on disk
(FlexGen's benchmarks do the same). Every tensor is a slice of one shared random buffer, so a
70B-shaped store costs one buffer of the largest matrix, not 140 GB."""

from __future__ import annotations

import torch


class DummyStore:
    """Weights of ``cfg``'s shapes, all slices of one shared random buffer (values ~N(0, 0.02))."""

    def __init__(self, cfg, family, dtype=torch.float16, seed: int = 0):
        self.dtype = dtype
        self.shapes = {}
        gn = family.global_weight_names(cfg)
        H, V = cfg.hidden_size, cfg.vocab_size
        for short, name in gn.items():
            if short in ("embed", "lm_head"):
                self.shapes[name] = (V, H)
            elif short == "pos_embed":
                self.shapes[name] = (cfg.max_position_embeddings + 2, H)
            elif short in ("norm", "final_norm", "final_norm_bias"):
                self.shapes[name] = (H,)
        I, q, kv = cfg.intermediate_size, cfg.q_size, cfg.kv_size
        mats = {"q": (q, H), "k": (kv, H), "v": (kv, H), "o": (H, q), "gate": (I, H), "up": (I, H),
                "down": (H, I), "fc1": (I, H), "fc2": (H, I)}
        vecs = {"q_bias": q, "k_bias": kv, "v_bias": kv, "o_bias": H, "fc1_bias": I, "fc2_bias": H}
        opt = cfg.family == "opt"
        for i in range(cfg.num_layers):
            for short, name in family.layer_weight_names(cfg, i).items():
                if short in mats:
                    self.shapes[name] = mats[short]
                elif short in vecs and opt:
                    self.shapes[name] = (vecs[short],)
                elif "norm" in short and (opt or not short.endswith("bias")):
                    self.shapes[name] = (H,)
        n = max(a * (b if len(s) > 1 else 1) for s in self.shapes.values() for a, b in [(s[0], s[-1])])
        g = torch.Generator().manual_seed(seed)
        self.buf = (torch.randn(n, generator=g) * 0.02).to(dtype)

    def names(self):
        return list(self.shapes)

    def shape(self, name):
        return self.shapes[name]

    def get(self, name):
        s = self.shapes[name]
        if "norm" in name and name.endswith("weight"):
            return torch.ones(s, dtype=self.dtype)
        n = 1
        for d in s:
            n *= d
        return self.buf[:n].view(s)
