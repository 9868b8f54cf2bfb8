"""The airline domain's tools: look up users, reservations and flights; book, cancel and
update reservations; send certificates.

Each tool has the benchmark's name, arguments, effect on the database and error conditions
(the same messages, read by the agent as ``Error: ...``). Every tool takes the episode's
:class:`~areal_agents.envs.tau2.db.Database` as the bound parameter ``db``;
:func:`airline_tools` binds them to one episode. Write tools check everything before they
change anything, so a failed call leaves the database as it was. As in the benchmark,
"now" is 2024-05-15 15:00 EST, new reservations get the ids HATHAT, HATHAU, HATHAV and new
certificates the ids certificate_3221322 to certificate_3221324; cancelling or changing
flights does not give seats back to the flights.

One deliberate difference (read-only): ``search_onestop_flight`` looks for the second leg on
the next day (zero-padded date) when the first leg arrives after midnight.
"""

from __future__ import annotations

import copy
import datetime as dt
from typing import Any, Literal

from areal_agents.envs.tau2.db import Database, Record
from areal_agents.envs.tau2.generic import GENERIC_TOOLS, dump, fail
from areal_agents.tools.tool import Tool, function_tool

WRITE_TOOLS = frozenset(
    {
        "book_reservation",
        "cancel_reservation",
        "send_certificate",
        "update_reservation_baggages",
        "update_reservation_flights",
        "update_reservation_passengers",
    }
)
"""The airline tools that change the database."""

Cabin = Literal["basic_economy", "economy", "business"]
NOW = "2024-05-15T15:00:00"
_NEW_RESERVATION_IDS = ("HATHAT", "HATHAU", "HATHAV")
_NEW_CERTIFICATE_IDS = ("certificate_3221322", "certificate_3221323", "certificate_3221324")
_AIRPORTS = (
    ("SFO", "San Francisco"),
    ("JFK", "New York"),
    ("LAX", "Los Angeles"),
    ("ORD", "Chicago"),
    ("DFW", "Dallas"),
    ("DEN", "Denver"),
    ("SEA", "Seattle"),
    ("ATL", "Atlanta"),
    ("MIA", "Miami"),
    ("BOS", "Boston"),
    ("PHX", "Phoenix"),
    ("IAH", "Houston"),
    ("LAS", "Las Vegas"),
    ("MCO", "Orlando"),
    ("EWR", "Newark"),
    ("CLT", "Charlotte"),
    ("MSP", "Minneapolis"),
    ("DTW", "Detroit"),
    ("PHL", "Philadelphia"),
    ("LGA", "LaGuardia"),
)

_FLIGHT_ITEM = {
    "type": "object",
    "properties": {
        "flight_number": {"type": "string", "description": "Flight number, such as 'HAT001'."},
        "date": {"type": "string", "description": "Flight date, such as '2024-05-01'."},
    },
    "required": ["flight_number", "date"],
}
_PASSENGER_ITEM = {
    "type": "object",
    "properties": {
        "first_name": {"type": "string", "description": "The passenger's first name."},
        "last_name": {"type": "string", "description": "The passenger's last name."},
        "dob": {"type": "string", "description": "Date of birth, YYYY-MM-DD."},
    },
    "required": ["first_name", "last_name", "dob"],
}
_PAYMENT_ITEM = {
    "type": "object",
    "properties": {
        "payment_id": {
            "type": "string",
            "description": "A payment method id from the user profile, such as "
            "'credit_card_7815826' or 'certificate_7815826'.",
        },
        "amount": {"type": "integer", "description": "Amount in whole dollars."},
    },
    "required": ["payment_id", "amount"],
}
_ITEM_SCHEMAS = {
    "flights": _FLIGHT_ITEM,
    "passengers": _PASSENGER_ITEM,
    "payment_methods": _PAYMENT_ITEM,
}


# ---------------------------------------------------------------------------- lookups


def _user(db: Database, user_id: str) -> Record:
    user = db.get("users", user_id)
    if user is None:
        raise fail(f"User {user_id} not found")
    return user


def _reservation(db: Database, reservation_id: str) -> Record:
    reservation = db.get("reservations", reservation_id)
    if reservation is None:
        raise fail(f"Reservation {reservation_id} not found")
    return reservation


def _flight(db: Database, flight_number: str) -> Record:
    flight = db.get("flights", flight_number)
    if flight is None:
        raise fail(f"Flight {flight_number} not found")
    return flight


def _flight_date(db: Database, flight_number: str, date: str) -> Record:
    flight = _flight(db, flight_number)
    if date not in flight["dates"]:
        raise fail(f"Flight {flight_number} not found on date {date}")
    return flight["dates"][date]


def _bookable(db: Database, flight_number: str, date: str, cabin: str, seats: int) -> Record:
    """The flight's status on ``date``, which must be available with ``seats`` free seats."""
    status = _flight_date(db, flight_number, date)
    if status["status"] != "available":
        raise fail(f"Flight {flight_number} not available on date {date}")
    if status["available_seats"][cabin] < seats:
        raise fail(f"Not enough seats on flight {flight_number}")
    return status


def _flight_infos(flights: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [{"flight_number": f["flight_number"], "date": f["date"]} for f in flights]


def _passengers(passengers: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [
        {"first_name": p["first_name"], "last_name": p["last_name"], "dob": p["dob"]}
        for p in passengers
    ]


def _payments(payments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    result = []
    for payment in payments:
        amount = payment["amount"]
        if isinstance(amount, float) and not amount.is_integer():
            raise fail(f"Payment amount must be a whole number of dollars, got {amount}")
        result.append({"payment_id": payment["payment_id"], "amount": int(amount)})
    return result


def _pay_for_update(db: Database, user_id: str, payment_id: str, total: int) -> Record | None:
    """Charge ``total`` (may be negative: a refund) for a change; the payment record or None.

    Raises (before any change) if the method is unknown, a certificate, or a gift card whose
    balance is too small.
    """
    method = _user(db, user_id)["payment_methods"].get(payment_id)
    if method is None:
        raise fail("Payment method not found")
    if method["source"] == "certificate":
        raise fail("Certificate cannot be used to update reservation")
    if method["source"] == "gift_card" and method["amount"] < total:
        raise fail("Gift card balance is not enough")
    if method["source"] == "gift_card":
        card = db.mutable("users", user_id)["payment_methods"][payment_id]
        card["amount"] -= total
    return {"payment_id": payment_id, "amount": total} if total != 0 else None


def _direct_flights(
    db: Database, date: str, origin: str | None, destination: str | None, after: str | None
) -> list[Record]:
    found = []
    for flight in db.values("flights"):
        status = flight["dates"].get(date)
        if (
            (origin is None or flight["origin"] == origin)
            and (destination is None or flight["destination"] == destination)
            and status is not None
            and status["status"] == "available"
            and (after is None or flight["scheduled_departure_time_est"] >= after)
        ):
            found.append(
                {
                    "flight_number": flight["flight_number"],
                    "origin": flight["origin"],
                    "destination": flight["destination"],
                    "status": "available",
                    "scheduled_departure_time_est": flight["scheduled_departure_time_est"],
                    "scheduled_arrival_time_est": flight["scheduled_arrival_time_est"],
                    "date": date,
                    "available_seats": dict(status["available_seats"]),
                    "prices": dict(status["prices"]),
                }
            )
    return found


# ---------------------------------------------------------------------------- read tools


def get_user_details(db: Database, user_id: str) -> str:
    """Get the details of a user: profile, payment methods, membership and reservations.

    Args:
        user_id: The user id, such as 'sara_doe_496'.
    """
    return dump(_user(db, user_id))


def get_reservation_details(db: Database, reservation_id: str) -> str:
    """Get the details of a reservation.

    Args:
        reservation_id: The reservation id, such as '8JX2WO'.
    """
    return dump(_reservation(db, reservation_id))


def get_flight_status(db: Database, flight_number: str, date: str) -> str:
    """Get the status of a flight on a date ('available', 'landed', 'cancelled', ...).

    Args:
        flight_number: The flight number, such as 'HAT001'.
        date: The date of the flight, such as '2024-05-01'.
    """
    return str(_flight_date(db, flight_number, date)["status"])


def list_all_airports(db: Database) -> str:
    """List every airport served: its IATA code and city."""
    return dump([{"iata": code, "city": city} for code, city in _AIRPORTS])


def search_direct_flight(db: Database, origin: str, destination: str, date: str) -> str:
    """Search the bookable direct flights between two airports on a date.

    Args:
        origin: The origin airport's IATA code, such as 'JFK'.
        destination: The destination airport's IATA code, such as 'LAX'.
        date: The date, YYYY-MM-DD, such as '2024-01-01'.
    """
    return dump(_direct_flights(db, date, origin, destination, None))


def search_onestop_flight(db: Database, origin: str, destination: str, date: str) -> str:
    """Search the bookable one-stop connections between two airports, leaving on a date.

    Args:
        origin: The origin airport's IATA code, such as 'JFK'.
        destination: The destination airport's IATA code, such as 'LAX'.
        date: The date of the first flight, YYYY-MM-DD, such as '2024-05-01'.
    """
    pairs = []
    for first in _direct_flights(db, date, origin, None, None):
        arrival = first["scheduled_arrival_time_est"]
        second_date = date
        if "+1" in arrival:
            try:
                day = dt.date.fromisoformat(date) + dt.timedelta(days=1)
            except ValueError:
                raise fail(f"Invalid date {date!r}; expected YYYY-MM-DD") from None
            second_date = day.isoformat()
        after = arrival.replace("+1", "")
        for second in _direct_flights(db, second_date, first["destination"], destination, after):
            pairs.append([first, second])
    return dump(pairs)


# ---------------------------------------------------------------------------- write tools


def book_reservation(
    db: Database,
    user_id: str,
    origin: str,
    destination: str,
    flight_type: Literal["one_way", "round_trip"],
    cabin: Cabin,
    flights: list[dict[str, Any]],
    passengers: list[dict[str, Any]],
    payment_methods: list[dict[str, Any]],
    total_baggages: int,
    nonfree_baggages: int,
    insurance: Literal["yes", "no"],
) -> str:
    """Book a reservation; the payments must add up to the total price.

    Total price: each flight's cabin price times the passengers, plus 30 per passenger for
    insurance, plus 50 per non-free bag.

    Args:
        user_id: The id of the user who books, such as 'sara_doe_496'.
        origin: The IATA code of the trip's origin, such as 'SFO'.
        destination: The IATA code of the trip's destination, such as 'JFK'.
        flight_type: 'one_way' or 'round_trip'.
        cabin: 'basic_economy', 'economy' or 'business'.
        flights: Every flight of the trip: objects with 'flight_number' and 'date'.
        passengers: Every passenger: objects with 'first_name', 'last_name' and 'dob'.
        payment_methods: The payments: objects with 'payment_id' and 'amount'.
        total_baggages: The total number of bags.
        nonfree_baggages: The number of bags that are paid for.
        insurance: Whether to buy travel insurance: 'yes' or 'no'.
    """
    flight_infos = _flight_infos(flights)
    people = _passengers(passengers)
    payments = _payments(payment_methods)
    user = _user(db, user_id)
    reservation_id = next((r for r in _NEW_RESERVATION_IDS if not db.has("reservations", r)), None)
    if reservation_id is None:
        raise fail("Too many reservations")
    booked, total = [], 0
    for info in flight_infos:
        flight = _flight(db, info["flight_number"])
        status = _bookable(db, info["flight_number"], info["date"], cabin, len(people))
        price = status["prices"][cabin]
        booked.append(
            {
                "flight_number": info["flight_number"],
                "origin": flight["origin"],
                "destination": flight["destination"],
                "date": info["date"],
                "price": price,
            }
        )
        total += price * len(people)
    if insurance == "yes":
        total += 30 * len(people)
    total += 50 * nonfree_baggages
    for payment in payments:
        method = user["payment_methods"].get(payment["payment_id"])
        if method is None:
            raise fail(f"Payment method {payment['payment_id']} not found")
        if (
            method["source"] in ("gift_card", "certificate")
            and method["amount"] < payment["amount"]
        ):
            raise fail(f"Not enough balance in payment method {payment['payment_id']}")
    paid = sum(payment["amount"] for payment in payments)
    if paid != total:
        raise fail(f"Payment amount does not add up, total price is {total}, but paid {paid}")

    user = db.mutable("users", user_id)
    for payment in payments:
        method = user["payment_methods"].get(payment["payment_id"])
        if method is not None and method["source"] == "gift_card":
            method["amount"] -= payment["amount"]
        elif method is not None and method["source"] == "certificate":
            del user["payment_methods"][payment["payment_id"]]
    for info in flight_infos:
        flight = db.mutable("flights", info["flight_number"])
        flight["dates"][info["date"]]["available_seats"][cabin] -= len(people)
    reservation = {
        "reservation_id": reservation_id,
        "user_id": user_id,
        "origin": origin,
        "destination": destination,
        "flight_type": flight_type,
        "cabin": cabin,
        "flights": booked,
        "passengers": people,
        "payment_history": payments,
        "created_at": NOW,
        "total_baggages": total_baggages,
        "nonfree_baggages": nonfree_baggages,
        "insurance": insurance,
    }
    db.insert("reservations", reservation_id, reservation)
    user["reservations"].append(reservation_id)
    return dump(reservation)


def cancel_reservation(db: Database, reservation_id: str) -> str:
    """Cancel a whole reservation: every payment is refunded to its method.

    Args:
        reservation_id: The reservation id, such as 'ZFA04Y'.
    """
    _reservation(db, reservation_id)
    reservation = db.mutable("reservations", reservation_id)
    refunds = [
        {"payment_id": payment["payment_id"], "amount": -payment["amount"]}
        for payment in reservation["payment_history"]
    ]
    reservation["payment_history"].extend(refunds)
    reservation["status"] = "cancelled"
    return dump(reservation)


def send_certificate(db: Database, user_id: str, amount: int) -> str:
    """Send a travel certificate of ``amount`` dollars to a user. Be careful!

    Args:
        user_id: The id of the user, such as 'sara_doe_496'.
        amount: The certificate's value in dollars.
    """
    methods = _user(db, user_id)["payment_methods"]
    certificate_id = next((c for c in _NEW_CERTIFICATE_IDS if c not in methods), None)
    if certificate_id is None:
        raise fail("Too many certificates")
    user = db.mutable("users", user_id)
    user["payment_methods"][certificate_id] = {
        "source": "certificate",
        "id": certificate_id,
        "amount": float(amount),
    }
    return f"Certificate {certificate_id} added to user {user_id} with amount {amount}."


def update_reservation_baggages(
    db: Database, reservation_id: str, total_baggages: int, nonfree_baggages: int, payment_id: str
) -> str:
    """Change the number of bags of a reservation (50 per extra non-free bag).

    Args:
        reservation_id: The reservation id, such as 'ZFA04Y'.
        total_baggages: The new total number of bags.
        nonfree_baggages: The new number of bags that are paid for.
        payment_id: A payment method id from the user profile, such as
            'credit_card_7815826' or 'gift_card_7815826' (certificates cannot be used).
    """
    reservation = _reservation(db, reservation_id)
    _user(db, reservation["user_id"])
    total = 50 * max(0, nonfree_baggages - reservation["nonfree_baggages"])
    payment = _pay_for_update(db, reservation["user_id"], payment_id, total)
    reservation = db.mutable("reservations", reservation_id)
    if payment is not None:
        reservation["payment_history"].append(payment)
    reservation["total_baggages"] = total_baggages
    reservation["nonfree_baggages"] = nonfree_baggages
    return dump(reservation)


def update_reservation_flights(
    db: Database,
    reservation_id: str,
    cabin: Cabin,
    flights: list[dict[str, Any]],
    payment_id: str,
) -> str:
    """Change the flights (and cabin) of a reservation; the fare difference is charged or
    refunded.

    Args:
        reservation_id: The reservation id, such as 'ZFA04Y'.
        cabin: The cabin class for the whole reservation: 'basic_economy', 'economy' or
            'business'.
        flights: EVERY flight of the new itinerary, unchanged ones included: objects with
            'flight_number' and 'date'.
        payment_id: A payment method id from the user profile, such as
            'credit_card_7815826' or 'gift_card_7815826' (certificates cannot be used).
    """
    flight_infos = _flight_infos(flights)
    reservation = _reservation(db, reservation_id)
    _user(db, reservation["user_id"])
    travellers = len(reservation["passengers"])
    new_flights, total = [], 0
    for info in flight_infos:
        kept = next(
            (
                f
                for f in reservation["flights"]
                if f["flight_number"] == info["flight_number"]
                and f["date"] == info["date"]
                and cabin == reservation["cabin"]
            ),
            None,
        )
        if kept is not None:
            new_flights.append(dict(kept))
            total += kept["price"] * travellers
            continue
        flight = _flight(db, info["flight_number"])
        status = _bookable(db, info["flight_number"], info["date"], cabin, travellers)
        new_flights.append(
            {
                "flight_number": info["flight_number"],
                "origin": flight["origin"],
                "destination": flight["destination"],
                "date": info["date"],
                "price": status["prices"][cabin],
            }
        )
        total += status["prices"][cabin] * travellers
    total -= sum(f["price"] for f in reservation["flights"]) * travellers
    payment = _pay_for_update(db, reservation["user_id"], payment_id, total)
    reservation = db.mutable("reservations", reservation_id)
    if payment is not None:
        reservation["payment_history"].append(payment)
    reservation["flights"] = new_flights
    reservation["cabin"] = cabin
    return dump(reservation)


def update_reservation_passengers(
    db: Database, reservation_id: str, passengers: list[dict[str, Any]]
) -> str:
    """Change the passengers of a reservation (their number cannot change).

    Args:
        reservation_id: The reservation id, such as 'ZFA04Y'.
        passengers: Every passenger: objects with 'first_name', 'last_name' and 'dob'.
    """
    people = _passengers(passengers)
    reservation = _reservation(db, reservation_id)
    if len(people) != len(reservation["passengers"]):
        raise fail("Number of passengers does not match")
    reservation = db.mutable("reservations", reservation_id)
    reservation["passengers"] = people
    return dump(reservation)


_DOMAIN_FUNCTIONS: tuple[Any, ...] = (
    book_reservation,
    cancel_reservation,
    get_flight_status,
    get_reservation_details,
    get_user_details,
    list_all_airports,
    search_direct_flight,
    search_onestop_flight,
    send_certificate,
    update_reservation_baggages,
    update_reservation_flights,
    update_reservation_passengers,
)


def _build(fn: Any) -> Tool:
    """A domain function as a tool, with full item schemas for its object-list arguments."""
    tool = function_tool(fn, state_params=("db",))
    for name, prop in tool.parameters["properties"].items():
        if name in _ITEM_SCHEMAS:
            prop["items"] = copy.deepcopy(_ITEM_SCHEMAS[name])
    return tool


DB_TOOLS: tuple[Tool, ...] = tuple(_build(fn) for fn in _DOMAIN_FUNCTIONS)
"""The airline tools that use the database, unbound (``db`` is bound per episode)."""


def airline_tools(db: Database) -> list[Tool]:
    """Every airline tool, bound to one episode's database, sorted by name."""
    tools = [tool.bind(db=db) for tool in DB_TOOLS] + list(GENERIC_TOOLS)
    return sorted(tools, key=lambda tool: tool.name)
