"""A procedurally generated knowledge base of fictional entities, with multi-hop questions.

:func:`generate_knowledge_base` builds, from a seed, a small world whose facts no model
can have memorized:

- **Entities.** Countries, cities, rivers, universities, people and companies. Names are
  drawn from syllables (``Qorvalix``, ``Maren Tolvask``); every name is unique, and no
  name contains another one (so a mention is never ambiguous).
- **Relations.** Each is a function (one value per subject), so a question built from
  it has one answer::

      company --founded_by--> person        person --born_in--> city
      company --ceo--> person               person --studied_at--> university
      company --headquartered_in--> city    university --located_in--> city
      city --in_country--> country          city --on_river--> river
      river --rises_in--> country

  The relation graph has no cycle, so the answer to a question is never the entity it
  starts from.
- **Attributes.** Literal facts at the end of a chain: a country's currency and
  language, a company's industry and founding year, a person's birth year.
- **Documents.** One per entity (``id`` like ``person-0007``, ``title`` = the name).
  The text states every relation and attribute of the entity in plain sentences, plus a
  few inverse facts (a city lists people born there), so the knowledge is spread over
  the corpus as in an encyclopedia.
- **Questions.** A question picks a start entity and walks ``hops`` documents along
  relations, then asks for the relation target or attribute found in the last document.
  The walk's other entities are described through the relations, never named::

      1 hop:  In which city was Maren Tolvask born?
      2 hops: Which river runs through the city where Qorvalix is headquartered?
      3 hops: In which country is the city where the founder of Qorvalix was born?

  Its gold ``chain`` is the ids of the documents to read, in order: each one mentions
  the next entity, and the last one states the answer. Questions whose answer text
  occurs in the question are dropped, and every question text is unique.

The generator is deterministic: the same arguments give the same documents and
questions (``random.Random(seed)``; no global state).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from areal_agents.tools.retriever import Document

__all__ = ["Entity", "KnowledgeBase", "QAExample", "generate_knowledge_base"]

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr",
           "kr", "tr", "th", "sh", "vr", "gl", "qu", "st"]  # fmt: skip
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou", "ya"]
_CODAS = ["", "", "", "n", "r", "l", "s", "x", "th", "m", "k", "v"]
_SUFFIXES = {
    "country": ["ia", "land", "stan", "ora", "eth"],
    "city": ["burg", "ford", "haven", "polis", "mere", "wick"],
    "river": ["", "", "a", "awa"],
    "university": [""],
    "company": ["ix", "ora", "tek", "ion", "ar", "is"],
    "currency": [""],
    "language": ["ic", "ish", "ese"],
}
_INDUSTRIES = ["shipbuilding", "textiles", "glassmaking", "pharmaceuticals", "aviation",
               "fishing", "mining", "publishing", "robotics", "brewing", "clockmaking",
               "solar energy"]  # fmt: skip
_PROFESSIONS = ["engineer", "chemist", "architect", "economist", "painter", "physician",
                "geologist", "composer", "lawyer", "botanist"]  # fmt: skip

# relation -> (subject type, object type)
RELATIONS: dict[str, tuple[str, str]] = {
    "founded_by": ("company", "person"),
    "ceo": ("company", "person"),
    "headquartered_in": ("company", "city"),
    "born_in": ("person", "city"),
    "studied_at": ("person", "university"),
    "located_in": ("university", "city"),
    "in_country": ("city", "country"),
    "on_river": ("city", "river"),
    "rises_in": ("river", "country"),
}
# attribute -> subject type
ATTRIBUTES: dict[str, str] = {
    "currency": "country",
    "language": "country",
    "industry": "company",
    "founded_year": "company",
    "birth_year": "person",
}
# How an entity reached through a relation is described: {x} is the subject's reference.
_REFERENCE = {
    "founded_by": "the founder of {x}",
    "ceo": "the chief executive of {x}",
    "headquartered_in": "the city where {x} is headquartered",
    "born_in": "the city where {x} was born",
    "studied_at": "the university where {x} studied",
    "located_in": "the city where {x} is located",
    "in_country": "the country in which {x} lies",
    "on_river": "the river that runs through {x}",
    "rises_in": "the country where {x} rises",
}
# The final question for a relation or attribute of the last entity.
_QUESTION = {
    "founded_by": "Who founded {x}?",
    "ceo": "Who is the chief executive of {x}?",
    "headquartered_in": "In which city is {x} headquartered?",
    "born_in": "In which city was {x} born?",
    "studied_at": "At which university did {x} study?",
    "located_in": "In which city is {x} located?",
    "in_country": "In which country is {x}?",
    "on_river": "Which river runs through {x}?",
    "rises_in": "In which country does {x} rise?",
    "currency": "What is the currency of {x}?",
    "language": "What language is spoken in {x}?",
    "industry": "In which industry does {x} operate?",
    "founded_year": "In which year was {x} founded?",
    "birth_year": "In which year was {x} born?",
}


@dataclass
class Entity:
    """One fictional entity: its document id, type, name, relations and attributes."""

    id: str
    type: str
    name: str
    relations: dict[str, str] = field(default_factory=dict)  # relation -> entity id
    attributes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class QAExample:
    """A question with its accepted answers (aliases; the first is canonical).

    ``chain`` is the gold sequence of document ids to read (empty for user QA files
    without one); ``hops`` is its length.
    """

    id: str
    question: str
    answers: tuple[str, ...]
    chain: tuple[str, ...] = ()
    hops: int = 0


@dataclass(frozen=True)
class KnowledgeBase:
    """A generated world: its entities, one document per entity, and the questions."""

    entities: dict[str, Entity]
    documents: list[Document]
    questions: list[QAExample]


class _Namer:
    """Unique syllable names; no name is a substring of another (case-insensitive)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.taken: list[str] = []

    def word(self, kind: str, syllables: tuple[int, int] = (2, 3)) -> str:
        for _ in range(1000):
            n = self.rng.randint(*syllables)
            parts = [
                self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS)
                for _ in range(n)
            ]
            name = ("".join(parts) + self.rng.choice(_SUFFIXES.get(kind, [""]))).capitalize()
            low = name.lower()
            if len(low) >= 4 and not any(low in t or t in low for t in self.taken):
                self.taken.append(low)
                return name
        raise RuntimeError("could not draw a fresh name; use fewer entities")


def generate_knowledge_base(
    seed: int = 0,
    *,
    n_countries: int = 6,
    n_cities: int = 18,
    n_rivers: int = 8,
    n_universities: int = 8,
    n_people: int = 48,
    n_companies: int = 24,
    n_questions: int = 600,
    hops: Sequence[int] = (1, 2, 3),
) -> KnowledgeBase:
    """Generate a knowledge base of fictional entities and multi-hop questions.

    Args:
        seed: everything is drawn from ``random.Random(seed)``.
        n_countries, n_cities, n_rivers, n_universities, n_people, n_companies: how many
            entities of each type (each at least 1).
        n_questions: how many questions to try to draw (evenly over ``hops``); fewer come
            back when the world is too small to phrase that many distinct questions.
        hops: the chain lengths to draw (each between 1 and 4).

    Returns:
        A :class:`KnowledgeBase`; questions have ids ``q00000``, ``q00001``, ...
    """
    counts = {"country": n_countries, "city": n_cities, "river": n_rivers,
              "university": n_universities, "person": n_people, "company": n_companies}  # fmt: skip
    for kind, count in counts.items():
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"n_{kind}: expected a positive int, got {count!r}")
    if not hops or any(h not in (1, 2, 3, 4) for h in hops):
        raise ValueError(f"hops: expected values between 1 and 4, got {list(hops)!r}")
    rng = random.Random(seed)
    entities = _draw_entities(rng, counts)
    documents = [_document(e, entities, rng) for e in entities.values()]
    questions = _draw_questions(rng, entities, n_questions, list(hops))
    return KnowledgeBase(entities, documents, questions)


def _draw_entities(rng: random.Random, counts: dict[str, int]) -> dict[str, Entity]:
    namer = _Namer(rng)
    by_type: dict[str, list[Entity]] = {}
    for kind, count in counts.items():
        by_type[kind] = []
        for i in range(count):
            if kind == "person":
                name = f"{namer.word('person', (1, 2))} {namer.word('person', (2, 2))}"
            elif kind == "university":
                name = f"University of {namer.word('university', (2, 2))}"
            elif kind == "river":
                name = f"{namer.word('river', (1, 2))} River"
            else:
                name = namer.word(kind, (1, 2))
            by_type[kind].append(Entity(f"{kind}-{i:04d}", kind, name))
    for kind, entity_list in by_type.items():
        for entity in entity_list:
            for relation, (subject, target) in RELATIONS.items():
                if subject == kind:
                    entity.relations[relation] = rng.choice(by_type[target]).id
    for country in by_type["country"]:
        country.attributes["currency"] = namer.word("currency", (1, 2)).lower()
        country.attributes["language"] = namer.word("language", (1, 2))
    for company in by_type["company"]:
        company.attributes["industry"] = rng.choice(_INDUSTRIES)
        company.attributes["founded_year"] = str(rng.randint(1850, 2015))
    for person in by_type["person"]:
        person.attributes["birth_year"] = str(rng.randint(1920, 1995))
        person.attributes["profession"] = rng.choice(_PROFESSIONS)
    return {e.id: e for entities in by_type.values() for e in entities}


def _document(e: Entity, entities: dict[str, Entity], rng: random.Random) -> Document:
    """The encyclopedia-style text of one entity: every fact, in shuffled order."""

    def name(relation: str) -> str:
        return entities[e.relations[relation]].name

    def inverse(relation: str) -> list[str]:
        return sorted(o.name for o in entities.values() if o.relations.get(relation) == e.id)

    a, facts = e.attributes, []
    if e.type == "country":
        lead = f"{e.name} is a country."
        facts = [f"The currency of {e.name} is the {a['currency']}.",
                 f"The official language of {e.name} is {a['language']}."]  # fmt: skip
        cities = inverse("in_country")
        if cities:
            facts.append(f"Cities in {e.name} include {_join(cities)}.")
    elif e.type == "city":
        lead = f"{e.name} is a city in {name('in_country')}."
        facts = [f"{e.name} lies on the {name('on_river')}."]
        natives = inverse("born_in")[:4]
        if natives:
            facts.append(f"People born in {e.name} include {_join(natives)}.")
    elif e.type == "river":
        lead = f"The {e.name} is a river that rises in {name('rises_in')}."
        cities = inverse("on_river")
        if cities:
            facts.append(f"Cities on the {e.name} include {_join(cities)}.")
    elif e.type == "university":
        lead = f"The {e.name} is a university located in {name('located_in')}."
    elif e.type == "person":
        lead = f"{e.name} is a {a['profession']} born in {a['birth_year']} in {name('born_in')}."
        facts = [f"{e.name} studied at the {name('studied_at')}."]
        facts += [f"{e.name} founded {c}." for c in inverse("founded_by")]
        facts += [f"{e.name} is the chief executive of {c}." for c in inverse("ceo")]
    else:  # company
        lead = f"{e.name} is a {a['industry']} company founded in {a['founded_year']}."
        facts = [f"{e.name} was founded by {name('founded_by')}.",
                 f"Its chief executive is {name('ceo')}.",
                 f"{e.name} is headquartered in {name('headquartered_in')}."]  # fmt: skip
    rng.shuffle(facts)
    return Document(e.id, e.name, " ".join([lead, *facts]))


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _draw_questions(
    rng: random.Random, entities: dict[str, Entity], n_questions: int, hops: list[int]
) -> list[QAExample]:
    out: list[QAExample] = []
    seen: set[str] = set()
    ids = sorted(entities)
    for i in range(n_questions):
        want = hops[i % len(hops)]
        for _ in range(50):  # retries: a walk can dead-end or repeat a question
            example = _walk(rng, entities, rng.choice(ids), want)
            if example is None or example[0] in seen:
                continue
            question, answer, chain = example
            if _norm(answer) in _norm(question):
                continue
            seen.add(question)
            answers = (answer, *_aliases(answer))
            out.append(QAExample(f"q{len(out):05d}", question, answers, chain, len(chain)))
            break
    return out


def _walk(
    rng: random.Random, entities: dict[str, Entity], start: str, hops: int
) -> tuple[str, str, tuple[str, ...]] | None:
    """Follow ``hops - 1`` relations from ``start``, then ask a relation or attribute of the
    last entity. Returns (question, answer, chain of document ids) or None at a dead end."""
    chain, path = [start], []
    for _ in range(hops - 1):
        relations = sorted(entities[chain[-1]].relations)
        if not relations:
            return None
        relation = rng.choice(relations)
        path.append(relation)
        chain.append(entities[chain[-1]].relations[relation])
    last = entities[chain[-1]]
    finals = sorted(last.relations) + sorted(k for k in last.attributes if k in _QUESTION)
    if not finals:
        return None
    final = rng.choice(finals)
    answer = entities[last.relations[final]].name if final in last.relations else None
    if answer is None:
        answer = last.attributes[final]
    reference = _mention(entities[start])
    for relation in path:
        reference = _REFERENCE[relation].format(x=reference)
    question = _QUESTION[final].format(x=reference)
    return question[0].upper() + question[1:], answer, tuple(chain)


def _mention(entity: Entity) -> str:
    """How a question names an entity: ``the Velo River``, ``the University of Tarn``."""
    return f"the {entity.name}" if entity.type in ("river", "university") else entity.name


def _aliases(answer: str) -> tuple[str, ...]:
    """Shorter accepted forms: ``Velo River`` -> ``Velo``, ``University of Tarn`` -> ``Tarn``."""
    if answer.endswith(" River"):
        return (answer.removesuffix(" River"),)
    if answer.startswith("University of "):
        return (answer.removeprefix("University of "),)
    return ()


def _norm(text: str) -> str:
    return " ".join("".join(c if c.isalnum() else " " for c in text.lower()).split())
