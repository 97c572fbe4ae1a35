"""Model families as their attention layers, the way deployments of them declare them.

Each family is a ``layout.layers`` list (``simsched.layout.Layer``) and the engine flags the
family is served with; the KV cache groups are left to each release's planner
(``simsched.planning``), so a case drawn here is a layout some deployment of that release
really has, and its pool passes, or fails, the release's own start-up checks. Layer counts are
small (a model's ratio of layer kinds, not its depth: the groups, not the number of layers,
shape what the scheduler does) and windows and chunks are scaled to the workloads' prompts of
16 to 190 tokens, so that they matter.
"""

from __future__ import annotations

import random

from simsched.case import Case
from simsched.layout import Layer

_MLA = {"kind": "mla", "head_size": 576}            # DeepSeek: kv_lora_rank 512 + rope 64
#: a compressor's ring (DeepSeek V4.1 CompressorStateCache: 8 float32 state rows a request)
_RING = {"kind": "ring", "block_size": 8, "num_kv_heads": 1, "head_size": 1024,
         "dtype": "float32"}

#: family -> (layers, engine flags, groups the pool is sized for)
FAMILIES: dict[str, tuple[list[dict], dict, int]] = {
    # Llama 3 style: full attention, grouped-query heads
    "dense": ([{"kind": "full", "count": 4}], {}, 1),
    # gpt-oss: full and sliding-window (128) layers alternating
    "gpt-oss": ([{"kind": "full", "count": 2, "head_size": 64},
                 {"kind": "sliding_window", "count": 2, "head_size": 64, "sliding_window": 128}],
                {}, 2),
    # Gemma 3 style: five sliding-window layers to one full, the window scaled to 64 (the
    # planner makes one group of each layer: six groups)
    "sliding-5to1": ([{"kind": "sliding_window", "count": 5, "sliding_window": 64},
                      {"kind": "full", "count": 1}], {}, 6),
    # Llama 4: three chunked local attention layers to one full (chunk scaled to 64)
    "llama4": ([{"kind": "chunked_local", "count": 3, "attention_chunk_size": 64},
                {"kind": "full", "count": 1}], {}, 1),
    # DeepSeek V3 style: MLA
    "deepseek-mla": ([dict(_MLA, count=4)], {}, 1),
    # EAGLE and EAGLE3 drafter heads over a dense model: one drafter attention layer
    "dense+eagle": ([{"kind": "full", "count": 4}, {"kind": "full", "drafter": True}],
                    {"speculative": {"method": "eagle", "num_tokens": 2}}, 1),
    "dense+eagle3": ([{"kind": "full", "count": 4}, {"kind": "full", "drafter": True}],
                     {"speculative": {"method": "eagle3", "num_tokens": 3}}, 1),
    "gpt-oss+eagle3": ([{"kind": "full", "count": 2, "head_size": 64},
                        {"kind": "sliding_window", "count": 2, "head_size": 64,
                         "sliding_window": 128},
                        {"kind": "full", "head_size": 64, "drafter": True}],
                       {"speculative": {"method": "eagle3", "num_tokens": 2}}, 3),
    # DeepSeek V4.1 style compressed attention (and Qwen4-exp's QSA): MLA layers at 64-token
    # blocks, each with a compressor's ring of the open token group (CompressorStateCache: a
    # CircularBufferSpec of 8 float32 state rows, one block per request; 0.29.0+)
    "mla+ring": ([dict(_MLA, count=4), dict(_RING, count=4)], {"block_size": 64}, 2),
    # DeepSeek V4 style: MLA layers, sliding-window MLA layers (the window scaled to 64) and the
    # compressor rings beside them
    "deepseek-v4": ([dict(_MLA, count=4), dict(_MLA, kind="sliding_window_mla", count=4,
                                               sliding_window=64),
                     dict(_RING, count=4)], {"block_size": 64}, 3),
    # Qwen3-Next style: Gated DeltaNet linear-attention layers (MambaBase, mamba_type gdn_attn)
    # three to one full attention layer, scaled down: 2 key and 4 value heads of 32 (conv state
    # (2*2*32 + 4*32, conv kernel 4 - 1), temporal state (4, 32, 32), bfloat16: 9,728 bytes) and
    # attention of 2 KV heads of 64 (512 bytes a token); the platform raises the block to 32
    # tokens (two 16-token kernel blocks hold the state) and pads the state page to 16 KiB
    "qwen3-next": ([{"kind": "mamba", "count": 3, "mamba_type": "gdn_attn",
                     "shapes": [[256, 3], [4, 32, 32]]},
                    {"kind": "full", "num_kv_heads": 2, "head_size": 64}], {}, 4),
    # Jamba style: Mamba (mamba1) layers seven to one attention layer, scaled down: d_inner
    # 512, d_conv 4, d_state 16 (conv state (512, 3), SSM state (512, 16), bfloat16: 19,456
    # bytes) beside 8 KV heads of 128 (4 KiB a token): a 16-token page holds the state, the
    # block stays 16 and the state page is padded to 64 KiB
    "jamba": ([{"kind": "mamba", "count": 7, "mamba_type": "mamba1",
                "shapes": [[512, 3], [512, 16]]},
               {"kind": "full", "count": 1}], {}, 8),
    # DeepSeek's MTP module: one MLA drafter layer
    "deepseek-mla+mtp": ([dict(_MLA, count=4), dict(_MLA, drafter=True)],
                         {"speculative": {"method": "mtp", "num_tokens": 1}}, 1),
}


def family_case(seed: int, family: str) -> Case:
    """A random workload (``simsched.lockstep.random_requests``) on ``family``, with a GPU pool
    of 24 to 96 blocks per group, small enough that the CPU tier serves hits."""
    from simsched.lockstep import random_requests, random_timing

    layers, flags, groups = FAMILIES[family]
    rng = random.Random(f"{family}/{seed}")
    reqs = random_requests(rng, seed, rng.randint(2, 8), flags.get("speculative"))
    engine = dict(flags, num_gpu_blocks=rng.choice([24, 32, 48, 96]) * groups,
                  cpu_chunks=rng.choice([16, 64, 256]))
    return Case.from_json({"layout": {"layers": layers, "engine": engine}, "requests": reqs,
                           "seed": seed, "timing": random_timing(rng)})


def family_of(layout) -> str | None:
    """The family whose layers ``layout`` has (None: another model)."""
    mine = list(layout.layers)
    for name, (layers, _, _) in FAMILIES.items():
        if [Layer.from_json(x, name) for x in layers] == mine:
            return name
    return None
