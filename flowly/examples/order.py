"""The order saga: reserve inventory, cool off durably, charge the card.

A failing charge releases the reservation (its compensation) and the run lands in
``dead_letter`` with both steps' outcomes visible from SQL::

    select name, status, attempts, error ->> 'message', compensation_status
    from flowly.steps where run_id = '<run id>' order by seq;

Run a worker for it with ``python -m flowly.worker --app flowly.examples.order``, then start runs
with ``flowly start order '{"sku": "book", "qty": 1, "card": "4242"}'``. A card of
``"0000"`` is declined. ``cooling_seconds`` in the input sets the durable sleep (default 2).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import flowly

logger = logging.getLogger(__name__)

# Stand-ins for the inventory and payment services; an idempotency key lets a real one
# de-duplicate a call repeated after a crash (steps are at-least-once).
STEP_SECONDS = 0.5


async def reserve_inventory(order: dict[str, Any], key: str) -> dict[str, Any]:
    await asyncio.sleep(STEP_SECONDS)
    logger.info("reserved %s x %s (key %s)", order["qty"], order["sku"], key)
    return {"reservation": f"res-{key}", "sku": order["sku"], "qty": order["qty"]}


async def release_inventory(reservation: dict[str, Any]) -> None:
    logger.info("released reservation %s", reservation["reservation"])


async def charge_payment(order: dict[str, Any], key: str) -> dict[str, Any]:
    await asyncio.sleep(STEP_SECONDS)
    if order.get("card") == "0000":
        raise RuntimeError(f"card {order['card']} declined")
    return {"charge": f"ch-{key}", "amount": order["qty"] * 10}


async def refund_payment(charge: dict[str, Any]) -> None:
    logger.info("refunded charge %s", charge["charge"])


@flowly.workflow("order")
async def order(ctx: flowly.Context, order: dict[str, Any]) -> dict[str, Any]:
    reservation = await ctx.step(
        "reserve_inventory",
        reserve_inventory, order, ctx.idempotency_key("reserve_inventory"),
        compensate=release_inventory,
    )
    await ctx.sleep("cooling_period", order.get("cooling_seconds", 2))
    charge = await ctx.step(
        "charge_payment",
        charge_payment, order, ctx.idempotency_key("charge_payment"),
        compensate=refund_payment,
        retry=flowly.Retry(max_attempts=2, backoff="fixed", initial_delay=0.2),
    )
    return {"reservation": reservation["reservation"], "charge": charge["charge"]}
