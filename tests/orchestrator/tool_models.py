"""Ten argument models as an agent's code writes them with pydantic (nested objects, optional fields, enums,
``Literal``, bounded numbers, string lengths and patterns, lists of models, dates), whose JSON schemas --
``Model.model_json_schema()`` and the ``openai`` SDK's ``pydantic_function_tool`` -- are the tool parameters
clients send (``test_tool_schemas.py``). Each comes with arguments it takes and arguments it refuses."""

from __future__ import annotations

import datetime as dt
import ipaddress
import pathlib
import uuid
from enum import Enum
from typing import Literal

from pydantic import BaseModel, Field, HttpUrl, IPvAnyAddress, SecretStr


class Unit(str, Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class GetWeather(BaseModel):
    """The weather in a city."""

    city: str = Field(min_length=1, max_length=40, description="The city")
    unit: Unit = Unit.celsius
    days: int = Field(1, ge=1, le=7)


class Address(BaseModel):
    street: str
    city: str
    postcode: str = Field(pattern=r"^[0-9]{5}$")


class CreateContact(BaseModel):
    """A contact with an optional address."""

    name: str = Field(max_length=60)
    email: str | None = None
    address: Address | None = None
    tags: list[str] = Field(default_factory=list, max_length=5)


class Item(BaseModel):
    sku: str = Field(pattern=r"^[A-Z]{3}-\d{3}$")
    quantity: int = Field(ge=1, le=100)


class PlaceOrder(BaseModel):
    """An order of one to ten lines."""

    customer_id: int = Field(gt=0)
    items: list[Item] = Field(min_length=1, max_length=10)
    express: bool = False


class BookMeeting(BaseModel):
    """A meeting at a time, for a while."""

    title: str
    start: dt.datetime
    minutes: int = Field(30, ge=15, le=240, multiple_of=15)
    attendees: list[str] = Field(default_factory=list)


class SearchDocs(BaseModel):
    """Search the documents."""

    query: str = Field(min_length=1)
    limit: int = Field(10, ge=1, le=50)
    sort: Literal["relevance", "date"] = "relevance"
    since: dt.date | None = None


class Transfer(BaseModel):
    """Move money between accounts."""

    source: str = Field(pattern=r"^[A-Z]{2}[0-9]{6}$")
    target: str = Field(pattern=r"^[A-Z]{2}[0-9]{6}$")
    amount: float = Field(gt=0, le=10000)
    currency: Literal["EUR", "USD", "GBP"]
    note: str | None = Field(None, max_length=80)


class Point(BaseModel):
    lat: float = Field(ge=-90, le=90)
    lon: float = Field(ge=-180, le=180)


class PlanRoute(BaseModel):
    """A route through two to five stops."""

    stops: list[Point] = Field(min_length=2, max_length=5)
    mode: Literal["walk", "bike", "car"] = "walk"
    avoid_tolls: bool | None = None


class Rating(BaseModel):
    """A rating of a product."""

    product_id: str = Field(min_length=3, max_length=12)
    stars: int = Field(ge=1, le=5)
    review: str | None = Field(None, max_length=200)
    verified: bool = False


class Step(BaseModel):
    name: str
    retries: int = Field(0, ge=0, le=3)


class RunPipeline(BaseModel):
    """A pipeline of steps on an environment."""

    environment: Literal["dev", "staging", "prod"]
    steps: list[Step] = Field(min_length=1)
    dry_run: bool = True


class SetAlarm(BaseModel):
    """An alarm at a time of day."""

    at: dt.time
    label: str = Field("alarm", max_length=20)
    repeat: list[Literal["mon", "tue", "wed", "thu", "fri", "sat", "sun"]] = Field(default_factory=list, max_length=7)


class SignUp(BaseModel):
    """An account. Pydantic writes a ``format`` for every field but ``login``: ``uri`` and ``uuid`` are llguidance's
    (enforced), ``password``, ``binary``, ``path``, ``ipv4network`` and ``ipvanyaddress`` are not (plain strings)."""

    login: str = Field(max_length=12)
    password: SecretStr = Field(max_length=16)
    avatar: bytes = Field(max_length=16)
    home: pathlib.Path
    site: HttpUrl
    id: uuid.UUID
    subnet: ipaddress.IPv4Network
    server: IPvAnyAddress


MODELS = [GetWeather, CreateContact, PlaceOrder, BookMeeting, SearchDocs, Transfer, PlanRoute, Rating, RunPipeline,
          SetAlarm]  # fmt: skip

# Arguments each model takes, every key given (as a strict schema wants), and arguments it refuses.
VALID = {
    GetWeather: {"city": "Paris", "unit": "fahrenheit", "days": 7},
    CreateContact: {"name": "Ada", "email": None, "address": {"street": "1 Rue", "city": "Lyon", "postcode": "69001"},
                    "tags": ["a", "b"]},
    PlaceOrder: {"customer_id": 3, "items": [{"sku": "ABC-123", "quantity": 100}], "express": True},
    BookMeeting: {"title": "Sync", "start": "2026-12-06T10:30:00Z", "minutes": 45, "attendees": ["x@y.z"]},
    SearchDocs: {"query": "dflash", "limit": 50, "sort": "date", "since": "2026-02-28"},
    Transfer: {"source": "FR123456", "target": "DE654321", "amount": 12.5, "currency": "EUR", "note": None},
    PlanRoute: {"stops": [{"lat": -90, "lon": 180}, {"lat": 48.85, "lon": 2.35}], "mode": "bike", "avoid_tolls": None},
    Rating: {"product_id": "P-001", "stars": 5, "review": "Good", "verified": True},
    RunPipeline: {"environment": "prod", "steps": [{"name": "build", "retries": 3}, {"name": "test", "retries": 0}],
                  "dry_run": False},
    SetAlarm: {"at": "07:30:00Z", "label": "wake", "repeat": ["mon", "fri"]},
    SignUp: {"login": "ada", "password": "pw", "avatar": "abc", "home": "/home/ada", "site": "https://x.org/a",
             "id": "0b8bef8b-bede-4ffe-8ffe-effecbedba8b", "subnet": "10.0.0.0/8", "server": "::1"},
}  # fmt: skip
INVALID = {
    GetWeather: [{"city": "", "days": 1}, {"city": "Paris", "days": 8}, {"city": "x" * 41}],
    CreateContact: [{"name": "Ada", "address": {"street": "s", "city": "c", "postcode": "6900"}},
                    {"name": "Ada", "tags": ["1", "2", "3", "4", "5", "6"]}],
    PlaceOrder: [{"customer_id": 0, "items": [{"sku": "ABC-123", "quantity": 1}]}, {"customer_id": 1, "items": []},
                 {"customer_id": 1, "items": [{"sku": "AB-123", "quantity": 1}]},
                 {"customer_id": 1, "items": [{"sku": "ABC-123", "quantity": 101}]}],
    BookMeeting: [{"title": "t", "start": "2026-13-01T10:00:00Z"}, {"title": "t", "start": "2026-12-06T10:00:00Z",
                                                                   "minutes": 20}],
    SearchDocs: [{"query": ""}, {"query": "q", "limit": 0}, {"query": "q", "sort": "name"},
                 {"query": "q", "since": "2026-02-30"}],
    Transfer: [{"source": "FR12345", "target": "DE654321", "amount": 1, "currency": "EUR"},
               {"source": "FR123456", "target": "DE654321", "amount": 0, "currency": "EUR"},
               {"source": "FR123456", "target": "DE654321", "amount": 1, "currency": "JPY"}],
    PlanRoute: [{"stops": [{"lat": 0, "lon": 0}]}, {"stops": [{"lat": 91, "lon": 0}, {"lat": 0, "lon": 0}]}],
    Rating: [{"product_id": "P1", "stars": 5}, {"product_id": "P-001", "stars": 6}],
    RunPipeline: [{"environment": "qa", "steps": [{"name": "b"}]}, {"environment": "dev", "steps": []},
                  {"environment": "dev", "steps": [{"name": "b", "retries": 4}]}],
    SetAlarm: [{"at": "25:00:00Z"}, {"at": "07:00:00Z", "repeat": ["monday"]}],
    SignUp: [VALID[SignUp] | {"id": "0b8bef8b"}, VALID[SignUp] | {"site": "x.org"},
             VALID[SignUp] | {"login": "a" * 13}],
}  # fmt: skip


def schemas(model) -> dict[str, dict]:
    """The model's parameters as each client writes them: pydantic's own schema, and the OpenAI SDK's strict
    function tool (every key required, optional ones nullable, ``additionalProperties: false``)."""
    import openai

    tool = openai.pydantic_function_tool(model)["function"]
    return {"pydantic": model.model_json_schema(), "openai": tool["parameters"]}
