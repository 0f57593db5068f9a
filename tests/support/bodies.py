"""Request bodies the tests share: the golden request of the encoding tests (`REQUEST`), one request of each question
type that `i` varies (`make_request`), the complaint the explanation tests take apart (`TEXT_STATE`, `QUESTIONS`),
and the SDK's multipart body (`multipart`)."""

from __future__ import annotations

import json

import httpx

REQUEST = {
    "state": {"vendor": "Ünïcode GmbH", "total": 12.5, "lines": [{"sku": "A-1", "qty": 2}], "note": None},
    "questions": {
        "paid": {"type": "noul", "instructions": "Is the invoice paid?", "criteria": {"false": "Still open."}},
        "route": {"type": "choice", "instructions": {"ask": "Which team?", "hint": ["ap", "ar"]},
                  "criteria": {"zeta": "Z team", "alpha": None, "mid": {"team": "M", "tier": 2}}},
        "risk": {"type": "score", "instructions": "", "criteria": ["none", "some", "high"]},
    },
}

TONES = ["neutral", "angry", "calm"]  # deliberately not sorted: answers must keep the caller's order


def make_request(i: int, model: str = "jev-latest") -> dict:
    """A request with one question of each type; `i` varies the state and the schema."""
    return {
        "model": model,
        "state": {"ticket": f"Customer {i} says: I was charged {i + 1} times for order {1000 + i}.",
                  "amount": 12.5 * (i + 1), "tags": ["billing"] * (i % 3)},
        "questions": {
            "billing": {"type": "noul", "instructions": f"Is ticket {i} about billing?"},
            "tone": {"type": "choice", "instructions": {"ask": "What is the tone?", "variant": i},
                     "criteria": {t: (None if t == "calm" else f"The customer sounds {t}.") for t in TONES}},
            "urgency": {"type": "score", "instructions": "How urgent is it?",
                        "criteria": ["can wait", {"level": "this week"}, "today", "now"][: 2 + i % 3]},
        },
        "some_future_field": {"ignored": True},  # unknown top-level fields are ignored
    }


SENTENCES = ["The parcel arrived with its box crushed.", "I have asked for a refund twice!",
             "Nobody answered my emails.", "It was a birthday present for my mother.",
             "Order 1234 was also two weeks late.", "Please reply today?"]
TEXT_STATE = " ".join(SENTENCES[:3]) + "\n" + " ".join(SENTENCES[3:])
QUESTIONS = {
    "angry": {"type": "noul", "instructions": "Is the customer angry?"},
    "topic": {"type": "choice", "instructions": "What is it about?",
              "criteria": {"shipping": "Delivery or damage", "billing": "Money", "other": None}},
    "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["can wait", "this week", "today"]},
}


def multipart(request: dict, files: dict[str, bytes]) -> tuple[bytes, str]:
    """The TypeSafe SDK's multipart body: the JSON in a 'request' part, one part per asset."""
    fields = {"request": (None, json.dumps(request).encode(), "application/json")}
    fields.update({name: (name, data, "image/png") for name, data in files.items()})
    built = httpx.Request("POST", "http://x", files=fields)
    return built.read(), built.headers["content-type"]
