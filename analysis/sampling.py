"""Text from the global model: `dloco sample`, and the sample that ends a run's report.

Only the built-in LM (dloco.island.bytelm:task) turns ids into text, so only it is sampled.  Its ids
are the bytes of UTF-8 text or, when the run trained on a token file, the ids of the tokenizer the
file's sidecar names (`dloco tokenize --tokenizer bpe` writes FILE.tokenizer.json); a token file of
bytes is read as bytes.  Output is decoded with errors replaced: what a model writes need not be
UTF-8.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from dloco.analysis import export
from dloco.analysis.runinfo import RunTask
from dloco.island.task import BUILTIN
from dloco.protocol.errors import DlocoError

# The report's sample: a fixed prompt that the default corpus (Python sources) makes sense of, and a
# clock: a large model on a CPU is slow to sample, and the report must not wait minutes.
REPORT_PROMPT, REPORT_LENGTH, REPORT_TEMPERATURE, REPORT_TOP_K, REPORT_SEED = (
    "def ",
    200,
    0.8,
    40,
    0,
)
REPORT_BUDGET_S = 60.0
_REPLACEMENT = "\N{REPLACEMENT CHARACTER}".encode()


class SampleError(DlocoError):
    """The run's model cannot be sampled: another task, a token file whose ids name no text, an
    empty prompt."""


@dataclasses.dataclass(frozen=True)
class TextCodec:
    """Text to the model's ids and back."""

    name: str
    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]


def bytes_decode(ids: Sequence[int]) -> str:
    """Byte ids as UTF-8 text, bad sequences replaced; an id past 255 (a model whose vocabulary is
    larger than its data's) too."""
    return b"".join(bytes([i]) if 0 <= i < 256 else _REPLACEMENT for i in ids).decode(
        "utf-8", errors="replace"
    )


BYTES = TextCodec("bytes", lambda text: list(text.encode("utf-8")), bytes_decode)


def codec_for(options) -> TextCodec:
    """How the built-in LM with these options (RunTask.options) reads text: bytes, or its token
    file's tokenizer."""
    from dloco.island import data

    if options.get("tokens") is None:
        return BYTES
    tokens = Path(options["tokens"])
    sidecar = data.sidecar_path(tokens)
    info = (
        data.TokenFileInfo.from_json(sidecar.read_text(), str(sidecar))
        if sidecar.is_file()
        else None
    )
    if info is not None and info.tokenizer_file:
        path = sidecar.parent / info.tokenizer_file
        if not path.is_file():
            raise SampleError(
                f"the token file's sidecar {sidecar} names the tokenizer {path}, which does not"
                " exist"
            )
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(path))
        # tokenizers raises a bare Exception for a file it cannot parse
        except Exception as error:
            raise SampleError(f"cannot read the tokenizer {path}: {error}") from None
        return TextCodec(
            f"tokenizer {path.name}",
            lambda text: tokenizer.encode(text).ids,
            lambda ids: tokenizer.decode(list(ids)),
        )
    if info is not None and info.tokenizer == "bytes":
        return BYTES
    said = (
        f"says tokenizer {info.tokenizer!r} and names no tokenizer file"
        if info is not None
        else f"is missing ({sidecar})"
    )
    raise SampleError(
        f"the run trained on the token file {tokens}, whose sidecar {said}: its ids cannot be"
        " turned into text"
    )


def model_for(run: RunTask, params: dict):
    """The run's model (built by its task plug-in, as an island builds it) holding `params`."""
    require_lm(run)
    from dloco.analysis.globalmodel import build_task
    from dloco.island.task import first_difference
    from dloco.island.train import assign, flat_params

    model = build_task(run).model
    ours = {p: tuple(a.shape) for p, a in flat_params(model).items()}
    difference = first_difference({p: tuple(a.shape) for p, a in params.items()}, ours)
    # first_difference speaks of the merger's model: here it is the checkpoint's
    if difference is not None:
        said = difference.replace("the merger's", "the checkpoint's")
        raise SampleError(f"the checkpoint's model is not the one the run's task builds: {said}")
    assign(model, params)
    return model


def require_lm(run: RunTask) -> None:
    if run.task != BUILTIN:
        raise SampleError(
            f"sampling needs the built-in LM ({BUILTIN}); this run trained {run.task}"
        )


@dataclasses.dataclass(frozen=True)
class Sample:
    prompt_ids: list[int]
    # generated after the prompt
    ids: list[int]
    # prompt and continuation, decoded together (a character may span the two)
    text: str
    # fewer ids than asked for: the time budget ran out
    cut: bool


def continue_text(
    model,
    codec: TextCodec,
    prompt: str,
    length: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    budget_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Sample:
    """`length` ids generated after `prompt` (island.bytelm.generate), stopping early once
    `budget_s` has passed."""
    from dloco.island.bytelm import generate

    prompt_ids = list(codec.encode(prompt))
    if not prompt_ids:
        raise SampleError(
            f"the prompt {prompt!r} encodes to no tokens; give at least one character"
        )
    tokens = generate(model, prompt_ids, temperature, top_k, seed)
    started, ids = clock(), []
    for token in itertools.islice(tokens, length):
        ids.append(token)
        if budget_s is not None and clock() - started > budget_s:
            break
    return Sample(prompt_ids, ids, codec.decode(prompt_ids + ids), len(ids) < length)


def sample(
    run_dir: Path,
    prompt: str,
    length: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    record: int | None = None,
    run: RunTask | None = None,
) -> tuple[Sample, export.GlobalModel]:
    """`dloco sample`: the run's global model (checkpoint at `record`; None: the newest) continuing
    `prompt`."""
    # not a run directory: say so before anything else
    export.merger_dir(run_dir)
    run = run if run is not None else RunTask.read(run_dir)
    require_lm(run)
    codec = codec_for(run.options)
    global_model = export.load(run_dir, record)
    return (
        continue_text(
            model_for(run, global_model.params), codec, prompt, length, temperature, top_k, seed
        ),
        global_model,
    )


def fenced(text: str) -> list[str]:
    """`text` as a Markdown code block whose fence no line of it can close; control characters but
    newline and tab shown as U+FFFD, so that the report stays text."""
    shown = re.sub(
        r"[\x00-\x08\x0b-\x1f\x7f]", "\N{REPLACEMENT CHARACTER}", text.replace("\r\n", "\n")
    )
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", shown)), default=0))
    return [fence + "text", *shown.splitlines(), fence]


def report_lines(run: RunTask, run_dir: Path, trainer) -> list[str]:
    """The report's closing section: a short sample of the final global model, loaded into `trainer`
    (the report's Evaluator's: its model is the run's, compiled already).  Nothing for another task
    or a run without a checkpoint; a sample that fails says why instead of failing the report."""
    if run.task != BUILTIN:
        return []
    head = ["## Sample", ""]
    try:
        if not export.checkpoints(run_dir):
            return []
        global_model = export.load(run_dir)
        codec = codec_for(run.options)
        trainer.set_params(global_model.params)
        got = continue_text(
            trainer.model,
            codec,
            REPORT_PROMPT,
            REPORT_LENGTH,
            REPORT_TEMPERATURE,
            REPORT_TOP_K,
            REPORT_SEED,
            REPORT_BUDGET_S,
        )
    # the report is the run's record; a sample is an extra, and any failure of it is reported in it
    except Exception as error:
        return head + [f"No sample: {type(error).__name__}: {error}", ""]
    unit = "bytes" if codec is BYTES else "tokens"
    cut = (
        f" (cut at {len(got.ids)} {unit}: the sample may take {REPORT_BUDGET_S:.0f} s)"
        if got.cut
        else ""
    )
    return head + [
        (
            f"The final global model (checkpoint at record {global_model.record}) continuing"
            f" `{REPORT_PROMPT}`: {len(got.ids)} {unit}, temperature {REPORT_TEMPERATURE}, top-k"
            f" {REPORT_TOP_K}, seed {REPORT_SEED}{cut}; `dloco sample {run_dir} --prompt TEXT`"
            " makes more."
        ),
        "",
        *fenced(got.text),
        "",
    ]
