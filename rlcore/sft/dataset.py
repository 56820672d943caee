"""Supervised fine-tuning (`mode=sft`): chat data -> masked token sequences -> the FSDP2 trainer.

Data (`sft.dataset`):

- a ``.jsonl`` file, one ``{"messages": [{"role": ..., "content": ...}, ...]}`` per line; a row
  that is not valid JSON, has no message list, has a message without a string role/content, or
  has no assistant message is skipped and counted, with a warning naming the file and line;
- ``env``: demonstrations from the configured environment: each task's prompt messages answered
  by its reference answer (`Task.answer`, which must be a string) as the assistant message;
- otherwise a Hugging Face `datasets` name or `save_to_disk` directory (needs `datasets`).

Tokenization. Each conversation is rendered with the tokenizer's chat template one assistant
turn at a time: the text up to the turn's generation prompt is context (mask 0), the turn's text
up to and including the end-of-turn token (`eos_token`) is trained on (mask 1), and whatever the
template adds after it is context again. These are exactly the ids an RL episode sees (prompt
ids, then the sampled completion ending in eos), so an SFT checkpoint warm-starts RL on the same
token boundaries. Templates that render earlier turns differently once later ones follow are
reported per row, not guessed at.

Training (`actors/sft.py`). Steps take `sft.batch_examples` examples from a seeded per-epoch
permutation (the data order is a function of (seed, step): resume needs only the step), pack
them with `pack_for_ranks`, and run `TrainerCore.sft_step` (mean NLL over the batch's assistant
tokens).
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlcore.batch.packing import pack_for_ranks
from rlcore.batch.parallel_dims import data_parallel_size, shards_per_rank
from rlcore.envs import build_env
from rlcore.models.images import check_image, expand_image_tokens, to_array
from rlcore.types import Sample

log = logging.getLogger("rlcore")


class DataError(ValueError):
    """Unusable SFT data; the message starts with the config key it is about."""


@dataclass
class SFTData:
    """Tokenized examples and what was left out on the way."""

    samples: list[Sample]
    rows: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    """Reason -> rows left out (malformed, template, too long)."""

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


# -- reading -----------------------------------------------------------------------------------
def check_messages(row: Any, key: str) -> list[dict[str, str]]:
    """The row's messages, or ValueError saying what is wrong with it."""
    if not isinstance(row, dict):
        raise ValueError(f"row is a {type(row).__name__}, not an object")
    msgs = row.get(key)
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"no non-empty {key!r} list")
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"message {j} needs string 'role' and 'content'")
    if not any(m["role"] == "assistant" for m in msgs):
        raise ValueError("no assistant message (nothing to train on)")
    # "images": local file paths of a message's images (vision-language policies)
    return [
        {
            "role": m["role"],
            "content": m["content"],
            **({"images": m["images"]} if isinstance(m.get("images"), list) else {}),
        }
        for m in msgs
    ]


def read_jsonl(path: Path, key: str, data: SFTData, limit: int = 0) -> list[list[dict[str, str]]]:
    """Conversations of a JSONL file; malformed rows are skipped, counted and warned about."""
    out = []
    bad: list[str] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            data.rows += 1
            try:
                out.append(check_messages(json.loads(line), key))
            except ValueError as exc:  # json.JSONDecodeError is a ValueError too
                data.skip("malformed")
                bad.append(f"line {lineno}: {exc}")
            if limit and len(out) >= limit:
                break
    if bad:
        log.warning(
            "sft.dataset: skipped %d malformed row(s) of %s: %s%s",
            len(bad),
            path,
            "; ".join(bad[:5]),
            " ..." if len(bad) > 5 else "",
        )
    return out


def env_demonstrations(cfg, n: int) -> list[list[dict[str, str]]]:
    """Reference conversations of `cfg.env` (`Environment.demonstration_messages`: the task
    prompt answered with its reference answer; multi-turn environments play whole episodes)."""
    env = build_env(cfg.env)
    out = []
    for i in range(n):
        task = env.make_task(i, cfg.sft.split)
        conversation = env.demonstration_messages(task)
        if conversation is None:
            raise DataError(
                f"sft.dataset: environment {cfg.env.name!r} has no demonstrations (task {task.id}); use a JSONL dataset"
            )
        # images ride on the first message ("images" key; chat templates ignore it)
        if task.images:
            conversation[0] = {**conversation[0], "images": list(task.images)}
        out.append(conversation)
    return out


def read_hf_dataset(source: str, split: str, key: str, data: SFTData, limit: int = 0) -> list[list[dict[str, str]]]:
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"sft.dataset: {source!r} is neither a .jsonl file nor 'env', and the `datasets` "
            "package is not installed (uv add datasets)"
        ) from None
    try:
        if Path(source).expanduser().is_dir():
            ds = datasets.load_from_disk(str(Path(source).expanduser()))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[split]
        else:
            ds = datasets.load_dataset(source, split=split)
    except Exception as exc:  # network, missing split, bad name: all mean "cannot read this data"
        raise DataError(f"sft.dataset: cannot load {source!r} (split {split!r}): {type(exc).__name__}: {exc}") from None
    out, bad = [], 0
    for row in ds:
        data.rows += 1
        try:
            out.append(check_messages(row, key))
        except ValueError:
            data.skip("malformed")
            bad += 1
        if limit and len(out) >= limit:
            break
    if bad:
        log.warning("sft.dataset: skipped %d malformed record(s) of %s", bad, source)
    return out


def load_conversations(cfg, data: SFTData) -> list[list[dict[str, str]]]:
    s = cfg.sft
    if s.dataset == "env":
        data.rows = s.num_examples
        return env_demonstrations(cfg, s.num_examples)
    path = Path(s.dataset).expanduser()
    if path.suffix == ".jsonl":
        if not path.is_file():
            raise DataError(f"sft.dataset: file {s.dataset!r} does not exist")
        return read_jsonl(path, s.messages_key, data, s.num_examples)
    return read_hf_dataset(s.dataset, s.split, s.messages_key, data, s.num_examples)


# -- tokenizing --------------------------------------------------------------------------------
def _render(tokenizer, messages: list[dict[str, str]], gen: bool) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)


def tokenize_conversation(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids and a 0/1 mask (1 = assistant tokens, trained on), per the module docstring.
    Raises ValueError when the template is not prefix-stable for this conversation."""
    eos = tokenizer.eos_token or ""
    ids: list[int] = []
    mask: list[int] = []
    covered = ""  # template text already turned into ids

    def add(text: str, m: int) -> None:
        if text:
            piece = tokenizer(text, add_special_tokens=False).input_ids
            ids.extend(piece)
            mask.extend([m] * len(piece))

    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], gen=True)
        full = _render(tokenizer, messages[: i + 1], gen=False)
        if not prompt.startswith(covered) or not full.startswith(prompt):
            raise ValueError("chat template renders earlier turns differently once later turns follow")
        add(prompt[len(covered) :], 0)
        turn = full[len(prompt) :]
        cut = turn.find(eos) if eos else -1
        trained = turn[: cut + len(eos)] if cut >= 0 else turn
        add(trained, 1)
        covered = prompt + trained
    return ids, mask


def to_sample(ids: list[int], mask: list[int], images: list | None = None) -> Sample:
    """An SFT example in the RL sample layout: everything before the first trained token is the
    prompt; the loss mask covers the rest (0 on context tokens between assistant turns)."""
    first = mask.index(1)
    n = len(ids) - first
    return Sample(
        prompt_ids=ids[:first],
        completion_ids=ids[first:],
        logprobs=[0.0] * n,
        versions=[0] * n,
        loss_mask=mask[first:],
        images=list(images or []),
    )


def expand_images(tokenizer, messages: list[dict], ids: list[int], mask: list[int]):
    """The conversation's images (messages' "images" lists, uint8) and the ids/mask with each
    image token expanded to the model's count (vision-language models)."""
    raw = [im for m in messages for im in m.get("images", ())]
    if not raw:
        return [], ids, mask
    spec = getattr(tokenizer, "rlcore_vision", None)
    if spec is None:
        raise DataError("sft.dataset: examples have images but the policy is a text-only model")
    images = [to_array(im) for im in raw]
    for arr in images:
        check_image(arr, spec)
    ids, mask = expand_image_tokens(ids, images, spec, mask)
    return images, ids, mask


def build_dataset(cfg, tokenizer) -> SFTData:
    """Read and tokenize `sft.dataset`. Raises DataError when nothing usable is left."""
    data = SFTData(samples=[])
    for messages in load_conversations(cfg, data):
        try:
            ids, mask = tokenize_conversation(tokenizer, messages)
        except ValueError:
            data.skip("template")
            continue
        if 1 not in mask:
            data.skip("empty")
            continue
        images, ids, mask = expand_images(tokenizer, messages, ids, mask)
        if len(ids) > cfg.sft.max_seq_len:
            data.skip("too_long")
            continue
        data.samples.append(to_sample(ids, mask, images))
    if data.skipped:
        log.warning("sft.dataset: %d of %d rows used; skipped %s", len(data.samples), data.rows, data.skipped)
    if not data.samples:
        raise DataError(
            f"sft.dataset: no usable example in {cfg.sft.dataset!r} ({data.rows} rows, skipped "
            f"{data.skipped or 'none'})"
        )
    return data


# -- data order --------------------------------------------------------------------------------
def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    order = list(range(n))
    if shuffle:
        random.Random(f"sft:{seed}:{epoch}").shuffle(order)
    return order


def batch_indices(step: int, batch: int, n: int, seed: int, shuffle: bool) -> tuple[list[int], int]:
    """Example indices of optimizer step `step` (0-based) and the epoch it ends in: the epochs'
    permutations concatenated, cut into consecutive batches."""
    start = step * batch
    out, epoch = [], start // n
    pos = start % n
    order = epoch_order(n, seed, epoch, shuffle)
    while len(out) < batch:
        if pos == n:
            epoch, pos = epoch + 1, 0
            order = epoch_order(n, seed, epoch, shuffle)
        take = min(batch - len(out), n - pos)
        out.extend(order[pos : pos + take])
        pos += take
    return out, epoch


def step_shards(cfg, data: SFTData, step: int):
    """Per-trainer-rank packed micro-batches of SFT step `step`, the global loss-token count, and
    the epoch the step ends in."""
    idx, epoch = batch_indices(step, cfg.sft.batch_examples, len(data.samples), cfg.seed, cfg.sft.shuffle)
    samples = [data.samples[i] for i in idx]
    shards = pack_for_ranks(
        samples, [0.0] * len(samples), data_parallel_size(cfg.trainer), cfg.trainer.micro_batch_tokens
    )
    loss_tokens = sum(int(mb.loss_mask.sum()) for shard in shards for mb in shard)
    # one entry per trainer rank: context-parallel ranks share their data-parallel shard
    return shards_per_rank(shards, cfg.trainer), loss_tokens, epoch
