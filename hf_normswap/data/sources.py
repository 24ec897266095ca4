"""Text sources as classes: one class a kind of source, chosen once from the spec, as a method is one class of
``modules.py``. A new kind is one class here, registered with :func:`register`: what calibration, evaluation, the
CLI's checks and the recovery recipe ask of a source (its documents, a cheap check before any model loads, a
training stream, whether it is the original's samples) is asked of the class.

Kinds are tried in :data:`SOURCES` order; a spec that none takes names local files (:class:`LocalFiles`) or, when
it names none, a Hub dataset (:class:`HubDataset`).
"""

from __future__ import annotations

from pathlib import Path

from . import texts
from .file_scan import FileText, scan
from .generated import DEFAULT_TOKENS, DrawShare, SamplingSettings, is_generated, sample_texts
from .sample_stream import sample_stream
from .streaming import file_stream, packed_stream, table_stream

SOURCES: list[type["Source"]] = []


def register(kind: type["Source"]) -> type["Source"]:
    """Add a kind of source (a class decorator)."""
    SOURCES.append(kind)
    return kind


class Source:
    """A text source named by ``spec``. A kind overrides :meth:`matches` and :meth:`texts`; the rest has defaults
    that fit a corpus read whole."""

    samples_original = False  # drawn from the original model (a recipe must hold it to read the source)

    def __init__(self, spec: str):
        self.spec = spec

    @classmethod
    def matches(cls, spec: str) -> bool:
        raise NotImplementedError

    def texts(self, default_split: str = "calibration", *, model=None, tokenizer=None, max_tokens: int | None = None,
              rank: int = 0, world_size: int = 1) -> list[str]:
        """Its documents (``default_split``: the half or split read where the spec names none)."""
        raise NotImplementedError

    def check(self) -> list[Path] | None:
        """What can be checked before a model loads, cheaply; the local files it names (None: no files)."""
        return None

    def preflight(self, split: str, block_len: int | None = None) -> None:
        """Read before any model loads, so a source that cannot be read, or that holds no whole block of
        ``block_len`` tokens (None: any text), stops a run at once."""
        documents = [t for t in self.texts(split, max_tokens=block_len or 1) if t.strip()]
        require_text(self.spec, FileText(sum(len(t.encode("utf-8", "surrogatepass")) for t in documents),
                                         len(documents)), block_len)

    def stream(self, tokenizer, block_len: int, *, original=None, rank: int = 0, world_size: int = 1, seed: int = 0):
        """Its training blocks as a ``datasets`` stream read as the run trains; None: read whole."""
        return None

    def sequence_length(self) -> int | None:
        """Tokens of a sequence it holds where the model's context must fit them (None: any)."""
        return None

    def same_sample(self, other: "Source") -> bool:
        """Whether ``other`` holds the very same sequences (two specs that draw the same samples)."""
        return False


@register
class Generated(Source):
    """``generated[:key=value,...]``: the original's own samples (``generated.py``), drawn once into the cache."""

    samples_original = True

    @classmethod
    def matches(cls, spec: str) -> bool:
        return is_generated(spec)

    @property
    def settings(self) -> SamplingSettings:
        try:
            return SamplingSettings.from_spec(self.spec)
        except ValueError as error:
            raise texts.DataError(str(error)) from None

    def prompt_texts(self) -> list[str] | None:
        prompt = self.settings.prompt
        return None if prompt == "bos" else source(prompt).texts("calibration")

    def texts(self, default_split="calibration", *, model=None, tokenizer=None, max_tokens=None, rank=0,
              world_size=1):
        try:  # a bad setting, a model that cannot sample: one DataError line
            return sample_texts(model, tokenizer, self.settings, max_tokens or DEFAULT_TOKENS,
                                prompt_texts=self.prompt_texts(), share=DrawShare(rank, world_size),
                                progress=rank == 0)
        except ValueError as error:
            raise texts.DataError(str(error)) from None

    def check(self):
        prompt = self.settings.prompt
        if prompt != "bos":
            source(prompt).check()
        return None

    def preflight(self, split, block_len=None):  # sampled once the original is loaded; its prompt file must exist
        self.check()

    def stream(self, tokenizer, block_len, *, original=None, rank=0, world_size=1, seed=0):
        return sample_stream(original, tokenizer, self.settings, block_len, prompt_texts=self.prompt_texts(),
                             rank=rank, world_size=world_size)

    def sequence_length(self):
        return self.settings.length

    def same_sample(self, other):
        return isinstance(other, Generated) and self.settings == other.settings


@register
class Builtin(Source):
    """``builtin`` or ``builtin:calibration`` / ``builtin:evaluation``: the Python reference shipped with Python."""

    @classmethod
    def matches(cls, spec: str) -> bool:
        return texts.is_builtin(spec)

    def texts(self, default_split="calibration", **_):
        return texts.read_builtin(self.spec.partition(":")[2] or default_split)


@register
class Repeated(Source):
    """``repeated:SPEC`` or ``repeated:words=N,copies=K:SPEC``: another source's text cut into passages of N words
    (default 150), each written K times in a row (default 2), a passage a document. After the first copy the text
    is predicted by copying it from the context, which the original does (its induction heads) and a converted model
    forgets; training on it teaches copying back (BENCHMARKS, "Fit for use"). Read whole."""

    PREFIX = "repeated:"
    DEFAULTS = {"words": 150, "copies": 2}
    LEAST = {"words": 1, "copies": 2}

    @classmethod
    def matches(cls, spec: str) -> bool:
        return spec.startswith(cls.PREFIX)

    @property
    def parts(self) -> tuple[dict[str, int], str]:
        """(settings, the inner spec); DataError for a setting that is not ``words`` or ``copies`` as a whole
        number, no inner spec, or the original's samples as the inner spec (drawn by the model, not read whole)."""
        rest = self.spec[len(self.PREFIX):]
        head, colon, inner = rest.partition(":")
        if not (colon and head and all("=" in pair for pair in head.split(","))):
            head, inner = "", rest
        settings = dict(self.DEFAULTS)
        for pair in filter(None, head.split(",")):
            key, _, value = pair.partition("=")
            key = key.strip()
            if key not in settings or not value.strip().isdigit() or int(value) < self.LEAST[key]:
                raise texts.DataError(f"{self.spec}: {pair!r} is not a setting of repeated: write "
                                      "repeated:words=N,copies=K:SPEC (N >= 1, K >= 2)")
            settings[key] = int(value)
        inner = inner.strip()
        if not inner:
            raise texts.DataError(f"{self.spec}: no text to repeat: write repeated:SPEC, e.g. repeated:FILE")
        if source(inner).samples_original:
            raise texts.DataError(f"{self.spec}: repeated: takes text read whole (files, builtin, a Hub dataset), "
                                  "not the original's samples")
        return settings, inner

    def texts(self, default_split="calibration", *, max_tokens=None, **kwargs):
        settings, inner = self.parts
        words, copies = settings["words"], settings["copies"]
        budget = None if max_tokens is None else -(-max_tokens // copies)
        passages = []
        for document in source(inner).texts(default_split, max_tokens=budget, **kwargs):
            tokens = document.split()
            passages += [" ".join(tokens[i:i + words]) for i in range(0, len(tokens), words)]
        return ["\n".join([passage] * copies) for passage in passages]

    def check(self):
        return source(self.parts[1]).check()


class LocalFiles(Source):
    """Local files and directories, joined by commas: text, json/jsonl or parquet. Training streams them, shuffled
    :data:`SHUFFLE_BLOCKS` blocks at a time (the Trainer shuffles a whole dataset's rows)."""

    SHUFFLE_BLOCKS = 1024

    @classmethod
    def matches(cls, spec: str) -> bool:
        return texts.names_paths(spec)

    def texts(self, default_split="calibration", *, max_tokens=None, **_):
        return texts.read_local(texts.named_paths(self.spec), max_tokens)

    def check(self):
        return texts.named_paths(self.spec)

    def preflight(self, split, block_len=None):  # every byte read, nothing kept: a stream must not fail later
        files = texts.files_under(texts.named_paths(self.spec))
        if not files:
            raise texts.DataError(f"no files under {self.spec}")
        require_text(self.spec, scan(files), block_len)

    def stream(self, tokenizer, block_len, *, original=None, rank=0, world_size=1, seed=0):
        files = texts.files_under(texts.named_paths(self.spec))
        loaders = {texts.LOADERS.get(f.suffix.lower()) for f in files}
        if not files or len(loaders) > 1:
            return None  # read whole, which names the problem (no files, mixed kinds)
        loader = loaders.pop()
        stream = file_stream(files, tokenizer, block_len) if loader is None else \
            table_stream(files, loader, tokenizer, block_len)
        if next(iter(stream.take(1)), None) is None:  # the check before loading bounds the tokens; this counts
            raise NoWholeBlock(f"{self.spec} gives fewer tokens than one block of {block_len}")
        return stream.shuffle(seed=seed, buffer_size=self.SHUFFLE_BLOCKS)


class HubDataset(Source):
    """``name[:config[:split]]``: a Hub dataset, read whole (``streaming: true`` streams it for training); what a
    spec names when no kind of :data:`SOURCES` takes it."""

    @classmethod
    def matches(cls, spec: str) -> bool:
        return True

    def texts(self, default_split="calibration", **_):
        split = {"calibration": "train", "evaluation": "test"}.get(default_split, default_split)
        return texts.read_hub(self.spec, split)


class NoWholeBlock(texts.DataError):
    """A source that holds text, but fewer tokens than one block of the length asked."""


def require_text(spec: str, found: FileText, block_len: int | None) -> None:
    """DataError unless ``found`` holds text and, ``block_len`` given, may hold a whole block: a training source
    without one trained 0 steps and saved its start as the result."""
    if not found.documents:
        raise texts.DataError(f"{spec} holds no text (empty or blank)")
    if block_len is not None and found.most_tokens() < block_len:
        raise NoWholeBlock(f"{spec} holds {found.text_bytes} bytes of text, fewer tokens than one block of "
                           f"{block_len}")


FALLBACKS = (LocalFiles, HubDataset)  # tried after every registered kind: paths, then any other name


def source(spec: str | None) -> Source:
    """The source a spec names (none: ``builtin``); DataError for a local path that does not exist."""
    spec = spec or texts.BUILTIN
    return next(kind for kind in (*SOURCES, *FALLBACKS) if kind.matches(spec))(spec)


def sample_length(spec: str | None) -> int | None:
    """The tokens of a sequence a spec holds where the model's context must fit them (the original's samples),
    else None."""
    return source(spec).sequence_length() if spec else None


def check_spec(spec: str) -> list[Path] | None:
    """What a text spec can be checked for before a model loads (local files exist, sampling settings are valid);
    returns the local files it names, None for other sources."""
    return source(spec).check()


def same_sample(spec: str | None, other: str | None) -> bool:
    """Whether two specs name the same samples of the original (same settings: the same batches)."""
    return bool(spec and other) and source(spec).same_sample(source(other))


def local_paths(spec: str) -> list[Path] | None:
    """The files a spec names, ``None`` for other sources; ``texts.DataError`` for a path that does not exist.

    Cheap, so the CLI can refuse a mistyped path before loading a model.
    """
    found = source(spec)
    return found.check() if isinstance(found, LocalFiles) else None


def load_texts(spec: str | None, default_split: str = "calibration", *, model=None, tokenizer=None,
               max_tokens: int | None = None, rank: int = 0, world_size: int = 1) -> list[str]:
    """Documents of a text source (``sources.source``). ``default_split`` picks the builtin half (and the Hub
    split, as train/test). ``generated`` text is sampled from ``model`` (the original) with ``tokenizer``, at least
    ``max_tokens`` tokens (default: :data:`generated.DEFAULT_TOKENS`); process ``rank`` of ``world_size`` draws its
    share and reads the others'. A large local text file is read only up to ``max_tokens`` (:data:`.texts.LAZY_BYTES`)."""
    return source(spec).texts(default_split, model=model, tokenizer=tokenizer, max_tokens=max_tokens, rank=rank,
                              world_size=world_size)


def hub_stream(spec: str, tokenizer, block_len: int, default_split: str = "train"):
    """The training blocks of a streamed Hub dataset (``streaming.packed_stream``); DataError for a spec that names
    another kind of source."""
    if not isinstance(source(spec), HubDataset):
        raise texts.DataError(f"streaming reads a Hub dataset NAME[:config][:split], not {spec!r}: set "
                              "streaming=false")
    return packed_stream(spec, tokenizer, block_len, default_split)
