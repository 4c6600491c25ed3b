"""convserve's HTTP layer: settings, app factory, the one request path, protocol adapters, CLI."""
