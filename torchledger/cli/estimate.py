"""``torchledger estimate``: closed-form napkin math (placeholder, filled in next)."""
import click


@click.group()
def estimate():
    """Closed-form estimates: params, train, memory, kv-cache, decode."""
