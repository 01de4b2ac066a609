"""Example workflows shipped with flowly, so ``flowly demo`` and the README's Quickstart work
from an installed package: ``flowly worker --app flowly.examples.order``."""
