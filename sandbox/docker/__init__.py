"""The Docker backend: ``backend`` (``DockerSandbox``, one hardened container per worker) and
``gateway`` (a stdlib-only TCP relay to service replicas that have no network).

Importing this package needs nothing; ``backend`` needs the docker SDK (the ``docker`` extra).
"""

from __future__ import annotations
