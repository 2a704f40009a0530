"""``sharpi synth``: write a random-weight GGUF model, or a geometry-only file of a real model.

sharpi synth -o tiny.gguf --arch qwen3moe --layers 4 --hidden 512 --experts 16 --type Q4_K
sharpi synth -o tiny.gguf --arch llama --experts 8 --type Q4_K --override 'ffn_down*=Q6_K'
sharpi synth --geometry qwen3-30b-a3b -o qwen3-30b-a3b.gguf
"""

from __future__ import annotations

import argparse
import collections
import logging

from engine.errors import UsageError
from engine.synth.specs import ARCHS


def register(sub: argparse._SubParsersAction) -> None:
    from engine.synth.geometry import GEOMETRIES
    from engine.synth.tokenizer import PRE_REGEXES

    p = sub.add_parser(
        "synth",
        help="write a synthetic GGUF (random weights, or a real model's geometry only)",
        description="Write a random-weight GGUF model llama.cpp can load, or a geometry-only file "
        "(real header and tensor table, sparse data hole) of a real model.",
    )
    p.add_argument("-o", "--output", required=True, help="path of the .gguf file to write")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--arch", choices=ARCHS, help="architecture of a random-weight model")
    what.add_argument("--geometry", choices=sorted(GEOMETRIES), help="write a real model's geometry only")
    g = p.add_argument_group("geometry of a random-weight model (unset = tiny per-architecture default)")
    for flag, field, helptext in (
        ("--layers", "layers", "number of blocks"),
        ("--hidden", "hidden", "embedding width D"),
        ("--heads", "heads", "query heads"),
        ("--kv-heads", "kv_heads", "key/value heads"),
        ("--head-dim", "head_dim", "width of one head"),
        ("--experts", "experts", "routed experts E (llama: >0 makes it Mixtral-style)"),
        ("--experts-used", "experts_used", "experts per token K"),
        ("--expert-ff", "expert_ff", "routed expert FFN width"),
        ("--ff", "ff", "dense FFN width (feed_forward_length)"),
        ("--shared-ff", "shared_ff", "shared expert width (qwen2moe, qwen35moe, qwen3next; glm4moe: × expert-ff)"),
        ("--vocab", "vocab", "vocabulary size (= embedding rows)"),
        ("--ctx", "ctx", "training context length"),
        ("--rope-dim", "rope_dim", "rotated dims per head (qwen35*, qwen3next, glm4moe; default a part of the head)"),
        ("--dense-lead", "dense_lead", "glm4moe: leading layers with a dense FFN"),
        ("--nextn", "nextn", "glm4moe, qwen35moe, qwen35, qwen3next: NextN/MTP blocks after the layers"),
        ("--ssm-conv", "ssm_conv", "GDN conv taps (qwen35*, qwen3next)"),
        ("--ssm-state", "ssm_state", "GDN key/value head width"),
        ("--ssm-groups", "ssm_groups", "GDN key heads"),
        ("--ssm-v-heads", "ssm_v_heads", "GDN value heads (a multiple of --ssm-groups)"),
        ("--full-attn-interval", "full_attn_interval", "every n-th layer is full attention"),
        ("--yarn-orig-ctx", "yarn_orig_ctx", "gpt-oss: YaRN's original context (rope.scaling.original_context_length)"),
    ):
        g.add_argument(flag, dest=field, type=int, help=helptext)
    g.add_argument("--rope-base", dest="rope_base", type=float, help="RoPE frequency base")
    g.add_argument(
        "--sliding-window", dest="sliding_window", type=int, help="gemma3, gpt-oss: attention.sliding_window"
    )
    g.add_argument("--yarn-factor", dest="yarn_factor", type=float, help="gpt-oss: YaRN RoPE scaling factor (0: none)")
    g.add_argument("--tied-output", dest="tied_output", action="store_true", default=None, help="omit output.weight")
    g.add_argument("--rope-freqs", dest="rope_freqs", action="store_true", default=None, help="llama: rope_freqs")
    g.add_argument("--expert-scale", dest="expert_scale", type=float, help="glm4moe: routed scaling factor")
    g.add_argument("--qk-norm", dest="qk_norm", action="store_true", default=None, help="glm4moe: per-head q/k norms")
    p.add_argument("--type", default="F32", help="weight type of the matrices (F32 F16 BF16 Q8_0 Q4_0 Q5_0 Q4_K ...)")
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="PATTERN=TYPE",
        help="type for tensors matching a glob, e.g. 'ffn_down*=Q6_K' (repeatable; later wins)",
    )
    p.add_argument(
        "--tokenizer",
        choices=["bpe", "harmony", "spm"],
        help="vocabulary kind (default: spm for llama and gemma3, harmony for gpt-oss, else bpe)",
    )
    p.add_argument("--pre", choices=sorted(PRE_REGEXES), help="BPE pre-tokenizer (default qwen2)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    p.add_argument(
        "--fill-random",
        action="store_true",
        help="with --geometry: fill the data with random, well-scaled quantized blocks (a real-sized file for speed work)",
    )
    p.set_defaults(func=run)


_GEOMETRY_FIELDS = [
    "layers",
    "hidden",
    "heads",
    "kv_heads",
    "head_dim",
    "experts",
    "experts_used",
    "expert_ff",
    "ff",
    "shared_ff",
    "vocab",
    "ctx",
    "rope_base",
    "tied_output",
    "rope_dim",
    "ssm_conv",
    "ssm_state",
    "ssm_groups",
    "ssm_v_heads",
    "full_attn_interval",
    "rope_freqs",
    "sliding_window",
    "dense_lead",
    "nextn",
    "expert_scale",
    "qk_norm",
    "yarn_factor",
    "yarn_orig_ctx",
]


def run(args: argparse.Namespace) -> int:
    if not getattr(args, "verbose", False):
        logging.getLogger("gguf").setLevel(logging.WARNING)  # the writer's INFO chatter
    if args.geometry:
        from engine.synth.geometry import write_geometry

        g = write_geometry(args.output, args.geometry)
        if args.fill_random:
            from engine.synth.fill import fill_random_blocks

            n = fill_random_blocks(g.path, seed=args.seed)
            print(f"filled {n / 1e9:.2f} GB of tensor data with random blocks")
        print(
            f"wrote {g.path}: {g.model.title} geometry, {len(g.tensors)} tensors, {g.file_size / 1e9:.2f} GB (sparse)"
        )
        _print_types(g.tensors)
        return 0
    from engine.synth.writer import write_model

    overrides = {}
    for item in args.override:
        pattern, sep, qtype = item.rpartition("=")
        if not sep or not pattern:
            raise UsageError(f"--override expects PATTERN=TYPE, got {item!r}")
        overrides[pattern] = qtype
    geometry = {f: getattr(args, f) for f in _GEOMETRY_FIELDS}
    m = write_model(
        args.output,
        args.arch,
        seed=args.seed,
        weight_type=args.type,
        type_overrides=overrides,
        tokenizer=args.tokenizer,
        pre=args.pre,
        **geometry,
    )
    size = m.path.stat().st_size
    s = m.spec
    print(f"wrote {m.path}: {s.arch}, {s.layers} layers, hidden {s.hidden}, vocab {s.vocab}, {size / 1e6:.1f} MB")
    _print_types(m.tensors)
    for p in m.tensors:
        if p.fell_back:
            print(f"  fallback {p.name}: {p.requested.name} -> {p.qtype.name} (rows of {p.shape[-1]})")
    return 0


def _print_types(plans) -> None:
    by_type: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for p in plans:
        by_type[p.qtype.name] += p.nbytes
        count[p.qtype.name] += 1
    for t, n in by_type.most_common():
        print(f"  {t:6s} {count[t]:5d} tensors {n / 1e6:12.1f} MB")
