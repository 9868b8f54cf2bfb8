"""The retail domain's tools: look up users, orders and products; cancel, modify, return,
exchange.

Each tool has the benchmark's name, arguments, effect on the database and error conditions
(the same messages, read by the agent as ``Error: ...``). Every tool takes the episode's
:class:`~areal_agents.envs.tau2.db.Database` as the bound parameter ``db``;
:func:`retail_tools` binds them to one episode. Write tools check everything before they
change anything, so a failed call leaves the database as it was.

One deliberate difference: ``modify_pending_order_items`` gives each modified item the price
and options of its own new variant (the upstream code gives every modified item those of
the last new item in the list, which makes the result depend on argument order).
"""

from __future__ import annotations

import copy
from typing import Any

from areal_agents.envs.tau2.db import Database, Record
from areal_agents.envs.tau2.generic import GENERIC_TOOLS, dump, fail
from areal_agents.tools.tool import Tool, function_tool

WRITE_TOOLS = frozenset(
    {
        "cancel_pending_order",
        "exchange_delivered_order_items",
        "modify_pending_order_address",
        "modify_pending_order_items",
        "modify_pending_order_payment",
        "modify_user_address",
        "return_delivered_order_items",
    }
)
"""The retail tools that change the database."""

_CANCEL_REASONS = ("no longer needed", "ordered by mistake")


# ---------------------------------------------------------------------------- lookups


def _order(db: Database, order_id: str) -> Record:
    order = db.get("orders", order_id)
    if order is None:
        raise fail("Order not found")
    return order


def _user(db: Database, user_id: str) -> Record:
    user = db.get("users", user_id)
    if user is None:
        raise fail("User not found")
    return user


def _product(db: Database, product_id: str) -> Record:
    product = db.get("products", product_id)
    if product is None:
        raise fail("Product not found")
    return product


def _variant(db: Database, product_id: str, item_id: str) -> Record:
    variants = _product(db, product_id)["variants"]
    if item_id not in variants:
        raise fail("Variant not found")
    return variants[item_id]


def _payment_method(db: Database, user_id: str, payment_method_id: str) -> Record:
    methods = _user(db, user_id)["payment_methods"]
    if payment_method_id not in methods:
        raise fail("Payment method not found")
    return methods[payment_method_id]


def _is_gift_card(method: Record) -> bool:
    return method.get("source") == "gift_card"


def _check_items_in_order(order: Record, item_ids: list[str], message: str) -> None:
    """Each id must occur in the order at least as often as in ``item_ids``."""
    present = [item["item_id"] for item in order["items"]]
    for item_id in item_ids:
        if item_ids.count(item_id) > present.count(item_id):
            raise fail(message.format(item_id=item_id))


def _address(address1: str, address2: str, city: str, state: str, country: str, zip: str) -> Record:
    return {
        "address1": address1,
        "address2": address2,
        "city": city,
        "country": country,
        "state": state,
        "zip": zip,
    }


# ---------------------------------------------------------------------------- read tools


def find_user_id_by_email(db: Database, email: str) -> str:
    """Find a user id by email address (case-insensitive).

    Args:
        email: The user's email address, such as 'something@example.com'.
    """
    for user_id in db.keys("users"):
        if _user(db, user_id)["email"].lower() == email.lower():
            return user_id
    raise fail("User not found")


def find_user_id_by_name_zip(db: Database, first_name: str, last_name: str, zip: str) -> str:
    """Find a user id by first name, last name and zip code.

    Use it only when the user cannot be found by email or does not remember it.

    Args:
        first_name: The user's first name, such as 'John'.
        last_name: The user's last name, such as 'Doe'.
        zip: The zip code of the user's address, such as '12345'.
    """
    for user_id in db.keys("users"):
        user = _user(db, user_id)
        if (
            user["name"]["first_name"].lower() == first_name.lower()
            and user["name"]["last_name"].lower() == last_name.lower()
            and user["address"]["zip"] == zip
        ):
            return user_id
    raise fail("User not found")


def get_order_details(db: Database, order_id: str) -> str:
    """Get the status and details of an order.

    Args:
        order_id: The order id, such as '#W0000000' (note the leading '#').
    """
    return dump(_order(db, order_id))


def get_product_details(db: Database, product_id: str) -> str:
    """Get the inventory details of a product: its variants, their options, price and stock.

    Args:
        product_id: The product id, such as '6086499569'. A product id is not an item id.
    """
    return dump(_product(db, product_id))


def get_user_details(db: Database, user_id: str) -> str:
    """Get the details of a user: name, address, email, payment methods and orders.

    Args:
        user_id: The user id, such as 'sara_doe_496'.
    """
    return dump(_user(db, user_id))


def list_all_product_types(db: Database) -> str:
    """List the name and product id of every product type (50 of them), sorted by name.

    Each product type has variants (items) with their own item ids and options.
    """
    names = {product["name"]: product["product_id"] for product in db.values("products")}
    return dump(dict(sorted(names.items())))


# ---------------------------------------------------------------------------- write tools


def cancel_pending_order(db: Database, order_id: str, reason: str) -> str:
    """Cancel a pending order and refund its payments.

    Refunds to a gift card are credited at once; others take 5-7 business days. Explain the
    details and get the user's explicit confirmation (yes) first.

    Args:
        order_id: The order id, such as '#W0000000' (note the leading '#').
        reason: Either 'no longer needed' or 'ordered by mistake'.
    """
    order = _order(db, order_id)
    if order["status"] != "pending":
        raise fail("Non-pending order cannot be cancelled")
    if reason not in _CANCEL_REASONS:
        raise fail("Invalid reason")
    methods = [
        _payment_method(db, order["user_id"], payment["payment_method_id"])
        for payment in order["payment_history"]
    ]
    refunds = [
        {
            "transaction_type": "refund",
            "amount": payment["amount"],
            "payment_method_id": payment["payment_method_id"],
        }
        for payment in order["payment_history"]
    ]
    for payment, method in zip(order["payment_history"], methods, strict=True):
        if _is_gift_card(method):
            user = db.mutable("users", order["user_id"])
            card = user["payment_methods"][payment["payment_method_id"]]
            card["balance"] = round(card["balance"] + payment["amount"], 2)
    order = db.mutable("orders", order_id)
    order["status"] = "cancelled"
    order["cancel_reason"] = reason
    order["payment_history"].extend(refunds)
    return dump(order)


def _price_difference(
    db: Database, order: Record, item_ids: list[str], new_item_ids: list[str], *, modify: bool
) -> tuple[float, list[Record]]:
    """The price difference of swapping ``item_ids`` for ``new_item_ids``, and the variants."""
    total: float = 0
    variants = []
    for item_id, new_item_id in zip(item_ids, new_item_ids, strict=True):
        if modify and item_id == new_item_id:
            raise fail("The new item id should be different from the old item id")
        item = next((it for it in order["items"] if it["item_id"] == item_id), None)
        if item is None:
            raise fail(f"Item {item_id} not found")
        variant = _variant(db, item["product_id"], new_item_id)
        if not variant["available"]:
            raise fail(f"New item {new_item_id} not found or available")
        total += variant["price"] - item["price"]
        variants.append(variant)
    return total, variants


def exchange_delivered_order_items(
    db: Database,
    order_id: str,
    item_ids: list[str],
    new_item_ids: list[str],
    payment_method_id: str,
) -> str:
    """Exchange items of a delivered order for other variants of the same products.

    A delivered order can be returned or exchanged only once. Explain the details and get the
    user's explicit confirmation (yes) first.

    Args:
        order_id: The order id, such as '#W0000000' (note the leading '#').
        item_ids: The item ids to exchange, such as ['1008292230']; may repeat.
        new_item_ids: The new item ids, position by position: each must be a variant of the
            same product as the item it replaces; may repeat.
        payment_method_id: The payment method that pays or receives the price difference,
            such as 'gift_card_0000000' or 'credit_card_0000000'.
    """
    order = _order(db, order_id)
    if order["status"] != "delivered":
        raise fail("Non-delivered order cannot be exchanged")
    _check_items_in_order(order, item_ids, "Number of {item_id} not found.")
    if len(item_ids) != len(new_item_ids):
        raise fail("The number of items to be exchanged should match.")
    difference, _ = _price_difference(db, order, item_ids, new_item_ids, modify=False)
    difference = round(difference, 2)
    method = _payment_method(db, order["user_id"], payment_method_id)
    if _is_gift_card(method) and method["balance"] < difference:
        raise fail("Insufficient gift card balance to pay for the price difference")
    order = db.mutable("orders", order_id)
    order["status"] = "exchange requested"
    order["exchange_items"] = sorted(item_ids)
    order["exchange_new_items"] = sorted(new_item_ids)
    order["exchange_payment_method_id"] = payment_method_id
    order["exchange_price_difference"] = difference
    return dump(order)


def modify_pending_order_address(
    db: Database,
    order_id: str,
    address1: str,
    address2: str,
    city: str,
    state: str,
    country: str,
    zip: str,
) -> str:
    """Change the shipping address of a pending order.

    Explain the details and get the user's explicit confirmation (yes) first.

    Args:
        order_id: The order id, such as '#W0000000' (note the leading '#').
        address1: The first address line, such as '123 Main St'.
        address2: The second address line, such as 'Apt 1', or ''.
        city: The city, such as 'San Francisco'.
        state: The state, such as 'CA'.
        country: The country, such as 'USA'.
        zip: The zip code, such as '12345'.
    """
    if "pending" not in _order(db, order_id)["status"]:
        raise fail("Non-pending order cannot be modified")
    order = db.mutable("orders", order_id)
    order["address"] = _address(address1, address2, city, state, country, zip)
    return dump(order)


def modify_pending_order_items(
    db: Database,
    order_id: str,
    item_ids: list[str],
    new_item_ids: list[str],
    payment_method_id: str,
) -> str:
    """Swap items of a pending order for other variants of the same products.

    This can be done only once per order. Explain the details and get the user's explicit
    confirmation (yes) first.

    Args:
        order_id: The order id, such as '#W0000000' (note the leading '#').
        item_ids: The item ids to modify, such as ['1008292230']; may repeat.
        new_item_ids: The new item ids, position by position: each must be a different
            variant of the same product as the item it replaces; may repeat.
        payment_method_id: The payment method that pays or receives the price difference,
            such as 'gift_card_0000000' or 'credit_card_0000000'.
    """
    order = _order(db, order_id)
    if order["status"] != "pending":
        raise fail("Non-pending order cannot be modified")
    _check_items_in_order(order, item_ids, "{item_id} not found")
    if len(item_ids) != len(new_item_ids):
        raise fail("The number of items to be exchanged should match")
    difference, variants = _price_difference(db, order, item_ids, new_item_ids, modify=True)
    method = _payment_method(db, order["user_id"], payment_method_id)
    if _is_gift_card(method) and method["balance"] < difference:
        raise fail("Insufficient gift card balance to pay for the new item")
    order = db.mutable("orders", order_id)
    order["payment_history"].append(
        {
            "transaction_type": "payment" if difference > 0 else "refund",
            "amount": abs(difference),
            "payment_method_id": payment_method_id,
        }
    )
    if _is_gift_card(method):
        card = db.mutable("users", order["user_id"])["payment_methods"][payment_method_id]
        card["balance"] = round(card["balance"] - difference, 2)
    for item_id, new_item_id, variant in zip(item_ids, new_item_ids, variants, strict=True):
        item = next(it for it in order["items"] if it["item_id"] == item_id)
        item["item_id"] = new_item_id
        item["price"] = variant["price"]
        item["options"] = copy.deepcopy(variant["options"])
    order["status"] = "pending (item modified)"
    return dump(order)


def modify_pending_order_payment(db: Database, order_id: str, payment_method_id: str) -> str:
    """Pay a pending order with another payment method (the old one is refunded).

    Explain the details and get the user's explicit confirmation (yes) first.

    Args:
        order_id: The order id, such as '#W0000000' (note the leading '#').
        payment_method_id: The new payment method, such as 'gift_card_0000000' or
            'credit_card_0000000'.
    """
    order = _order(db, order_id)
    if "pending" not in order["status"]:
        raise fail("Non-pending order cannot be modified")
    method = _payment_method(db, order["user_id"], payment_method_id)
    history = order["payment_history"]
    if len(history) != 1 or history[0]["transaction_type"] != "payment":
        raise fail("There should be exactly one payment for a pending order")
    old_id = history[0]["payment_method_id"]
    if old_id == payment_method_id:
        raise fail("The new payment method should be different from the current one")
    amount = history[0]["amount"]
    if _is_gift_card(method) and method["balance"] < amount:
        raise fail("Insufficient gift card balance to pay for the order")
    old_method = _payment_method(db, order["user_id"], old_id)
    order = db.mutable("orders", order_id)
    order["payment_history"].extend(
        [
            {
                "transaction_type": "payment",
                "amount": amount,
                "payment_method_id": payment_method_id,
            },
            {"transaction_type": "refund", "amount": amount, "payment_method_id": old_id},
        ]
    )
    for card_id, sign, card in ((payment_method_id, -1, method), (old_id, 1, old_method)):
        if _is_gift_card(card):
            mine = db.mutable("users", order["user_id"])["payment_methods"][card_id]
            mine["balance"] = round(mine["balance"] + sign * amount, 2)
    return dump(order)


def modify_user_address(
    db: Database,
    user_id: str,
    address1: str,
    address2: str,
    city: str,
    state: str,
    country: str,
    zip: str,
) -> str:
    """Change the default address of a user.

    Explain the details and get the user's explicit confirmation (yes) first.

    Args:
        user_id: The user id, such as 'sara_doe_496'.
        address1: The first address line, such as '123 Main St'.
        address2: The second address line, such as 'Apt 1', or ''.
        city: The city, such as 'San Francisco'.
        state: The state, such as 'CA'.
        country: The country, such as 'USA'.
        zip: The zip code, such as '12345'.
    """
    _user(db, user_id)
    user = db.mutable("users", user_id)
    user["address"] = _address(address1, address2, city, state, country, zip)
    return dump(user)


def return_delivered_order_items(
    db: Database, order_id: str, item_ids: list[str], payment_method_id: str
) -> str:
    """Request the return of items of a delivered order (status becomes 'return requested').

    The refund goes to the original payment method or to a gift card. The user gets an email
    on how to send the items back. Explain the details and get the user's explicit
    confirmation (yes) first.

    Args:
        order_id: The order id, such as '#W0000000' (note the leading '#').
        item_ids: The item ids to return, such as ['1008292230']; may repeat.
        payment_method_id: The payment method that receives the refund: the order's original
            one or a gift card, such as 'gift_card_0000000'.
    """
    order = _order(db, order_id)
    if order["status"] != "delivered":
        raise fail("Non-delivered order cannot be returned")
    method = _payment_method(db, order["user_id"], payment_method_id)
    original = order["payment_history"][0]["payment_method_id"]
    if not _is_gift_card(method) and payment_method_id != original:
        raise fail("Payment method should be the original payment method")
    _check_items_in_order(order, item_ids, "Some item not found")
    order = db.mutable("orders", order_id)
    order["status"] = "return requested"
    order["return_items"] = sorted(item_ids)
    order["return_payment_method_id"] = payment_method_id
    return dump(order)


_DOMAIN_FUNCTIONS: tuple[Any, ...] = (
    cancel_pending_order,
    exchange_delivered_order_items,
    find_user_id_by_email,
    find_user_id_by_name_zip,
    get_order_details,
    get_product_details,
    get_user_details,
    list_all_product_types,
    modify_pending_order_address,
    modify_pending_order_items,
    modify_pending_order_payment,
    modify_user_address,
    return_delivered_order_items,
)

DB_TOOLS: tuple[Tool, ...] = tuple(
    function_tool(fn, state_params=("db",)) for fn in _DOMAIN_FUNCTIONS
)
"""The retail tools that use the database, unbound (``db`` is bound per episode)."""


def retail_tools(db: Database) -> list[Tool]:
    """Every retail tool, bound to one episode's database, sorted by name."""
    tools = [tool.bind(db=db) for tool in DB_TOOLS] + list(GENERIC_TOOLS)
    return sorted(tools, key=lambda tool: tool.name)
