"""Data in, model out: `dloco tokenize` (text to a token file), `dloco export` (a run's global
model as safetensors) and `dloco sample` (text from it)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dloco.cliargs import float_at_least, int_at_least

_positive_int = int_at_least(1)


def add_tokenize(commands: argparse._SubParsersAction) -> None:
    """`dloco tokenize`: text to a token file."""
    tokenize = commands.add_parser(
        "tokenize",
        help="text to a token file (FILE.bin + FILE.json) that `dloco island --tokens` trains on",
    )
    tokenize.add_argument(
        "src",
        nargs="?",
        type=Path,
        default=None,
        help="file or folder of text (default: this Python's standard library sources)",
    )
    tokenize.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="FILE.bin",
        help="the token ids; FILE.json (and, for bpe, FILE.tokenizer.json) are written beside it",
    )
    tokenize.add_argument(
        "--tokenizer",
        choices=("bytes", "bpe"),
        default="bytes",
        help="bytes: each byte is a token (vocab 256); bpe: a byte-level BPE trained here on SRC",
    )
    tokenize.add_argument(
        "--vocab",
        type=_positive_int,
        default=None,
        help="bpe: the vocabulary to train (default 4096)",
    )
    tokenize.set_defaults(run=_tokenize)


def add_export(commands: argparse._SubParsersAction) -> None:
    """`dloco export RUN_DIR`: a run's global model as a safetensors file."""
    export = commands.add_parser(
        "export", help="write a run's global model (the merger's checkpoint) as a safetensors file"
    )
    _add_run_model(export)
    export.add_argument("--out", type=Path, required=True, metavar="FILE.safetensors")
    export.set_defaults(run=_export)


def add_sample(commands: argparse._SubParsersAction) -> None:
    """`dloco sample RUN_DIR`: text from a run's global model."""
    sample = commands.add_parser("sample", help="text from a run's global model (the built-in LM)")
    _add_run_model(sample)
    sample.add_argument(
        "--prompt",
        required=True,
        help="the text to continue (UTF-8; the run's tokenizer's ids for a BPE token file)",
    )
    sample.add_argument(
        "--length",
        type=_positive_int,
        default=200,
        help="tokens (bytes for the byte LM) to generate (default 200)",
    )
    sample.add_argument(
        "--temperature",
        type=float_at_least(0),
        default=0.8,
        help="softmax temperature; 0: always the likeliest (default 0.8)",
    )
    sample.add_argument(
        "--top-k",
        type=int_at_least(0),
        default=40,
        help="sample among the K likeliest; 0: among all (default 40)",
    )
    sample.add_argument(
        "--seed", type=int, default=0, help="the same seed gives the same text (default 0)"
    )
    sample.set_defaults(run=_sample)


def _add_run_model(tool: argparse.ArgumentParser) -> None:
    """The run directory and which of its models: a checkpoint, and the cluster file it ran."""
    tool.add_argument(
        "run_dir", type=Path, metavar="RUN_DIR", help="a run directory `dloco up` wrote"
    )
    tool.add_argument(
        "--checkpoint",
        type=int_at_least(0),
        default=None,
        metavar="N",
        help=(
            "the merger's checkpoint at log record N (merger/checkpoints/N.ckpt, as `dloco"
            " replay --verify` numbers them); default: the newest, after a clean stop the final"
            " model"
        ),
    )
    tool.add_argument(
        "--config",
        type=Path,
        default=None,
        help=(
            "the cluster file the run ran, for a run directory without task.json (made before"
            " runs recorded it)"
        ),
    )


def _tokenize(args: argparse.Namespace) -> int:
    from dloco.island import tokenizing
    from dloco.protocol import DlocoError

    def progress(line: str) -> None:
        print(f"dloco tokenize: {line}", file=sys.stderr, flush=True)

    try:
        report = tokenizing.tokenize(
            args.src, args.out, tokenizing.TokenizeConfig(args.tokenizer, args.vocab), progress
        )
    except (DlocoError, OSError) as error:
        print(f"dloco tokenize: {error}", file=sys.stderr)
        return 2
    print(f"dloco tokenize: {report.summary()}")
    return 0


def _run_task(args: argparse.Namespace):
    """The run's task from --config when given, else from the run directory (None: read there)."""
    from dloco.cluster import config
    from dloco.cluster.records import run_task

    return run_task(config.load(args.config)) if args.config is not None else None


def add_refold(commands: argparse._SubParsersAction) -> None:
    """`dloco refold RUN_DIR`: a run's logged deltas folded again with the momentum in another
    dtype."""
    refold = commands.add_parser(
        "refold",
        help=(
            "fold a run's logged deltas again with the outer momentum kept in another dtype: how"
            " far the model moves and both held-out losses"
        ),
    )
    refold.add_argument("run_dir", type=Path, help="the run's directory (dloco up's RUN_DIR)")
    refold.add_argument(
        "--momentum-dtype",
        choices=("float32", "bfloat16"),
        default="bfloat16",
        help="what to keep the momentum in (default %(default)s)",
    )
    refold.add_argument("--json", action="store_true", help="print one JSON object")
    refold.set_defaults(run=_refold)


def _refold(args: argparse.Namespace) -> int:
    import json

    from dloco.analysis.refold import compare
    from dloco.protocol import DlocoError

    try:
        result = compare(args.run_dir, args.momentum_dtype)
    except (DlocoError, OSError) as error:
        print(f"dloco refold: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"dloco refold: {result['folds']} folds; momentum in {result['momentum_dtype']} instead of"
        f" {result['logged_dtype']}: the model {result['relative_distance']:.2e} of its movement"
        f" away; held-out loss {result['loss_logged']:.4f} logged,"
        f" {result['loss_refolded']:.4f} refolded"
    )
    return 0


def _export(args: argparse.Namespace) -> int:
    from dloco.analysis import export
    from dloco.protocol import DlocoError

    try:
        model, meta = export.export(args.run_dir, args.out, args.checkpoint, _run_task(args))
    except DlocoError as error:
        print(f"dloco export: {error}", file=sys.stderr)
        return 2
    print(
        f"dloco export: wrote {args.out}: {len(model.params)} tensors, {model.count:,} parameters,"
        f" checkpoint at record {model.record}, fragment versions {list(model.versions)}, task"
        f" {meta['task']}"
    )
    return 0


def _sample(args: argparse.Namespace) -> int:
    from dloco.analysis import sampling
    from dloco.protocol import DlocoError

    try:
        got, model = sampling.sample(
            args.run_dir,
            args.prompt,
            args.length,
            args.temperature,
            args.top_k or None,
            args.seed,
            args.checkpoint,
            _run_task(args),
        )
    except DlocoError as error:
        print(f"dloco sample: {error}", file=sys.stderr)
        return 2
    print(got.text)
    print(
        f"dloco sample: {len(got.ids)} tokens after a {len(got.prompt_ids)}-token prompt,"
        f" checkpoint at record {model.record} (fragment versions {list(model.versions)}),"
        f" temperature {args.temperature:g}, top-k {args.top_k or 'all'}, seed {args.seed}",
        file=sys.stderr,
    )
    return 0
