#!/usr/bin/env python3
"""Container HEALTHCHECK: exit 0 when GET /healthz on the local server answers 200.

Standard library only, so the slim images need neither curl nor wget. The port follows
CONVSERVE_PORT, the same variable the server reads, so overriding the port cannot leave
the health check probing the wrong one."""
import os
import sys
import urllib.request


def main() -> int:
    port = os.environ.get("CONVSERVE_PORT", "8000")
    url = f"http://127.0.0.1:{port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=float(os.environ.get("HEALTHCHECK_TIMEOUT_S", "3"))) as resp:
            return 0 if resp.status == 200 else 1
    except Exception as exc:  # any failure (refused, timeout, non-2xx) is "unhealthy"
        print(f"healthcheck {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
