"""The order saga of the README's Quickstart: reserve inventory, cool off durably, charge.

Its code ships inside the package as :mod:`flowly.examples.order` (so ``flowly demo`` and
``flowly worker --app flowly.examples.order`` work from a pip install); this module is the
same workflow under the name a checkout uses: ``flowly worker --app examples.order``.
"""

from flowly.examples.order import (
    STEP_SECONDS,
    charge_payment,
    order,
    refund_payment,
    release_inventory,
    reserve_inventory,
)

__all__ = [
    "STEP_SECONDS",
    "charge_payment",
    "order",
    "refund_payment",
    "release_inventory",
    "reserve_inventory",
]
