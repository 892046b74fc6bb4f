"""Record the protocol's frames as today's code builds them: `python -m tests.protocol.record_frames`.

Run at a3d964b, before the protocol module replaced the hand-written builders (see `wire_builders.py`;
the last two builders' frames were recorded from a3d964b's code later; `task-broadcast` and
`task-inline` again when tasks gained `model_id`, issue 31, every other frame unchanged by it). Running it again overwrites
the record with what the code builds now, which defeats its purpose unless the wire format is meant
to change.
"""

from __future__ import annotations

import base64
import json
import tempfile
from pathlib import Path

from tests.protocol.wire_builders import BUILDERS, build

FRAMES = Path(__file__).with_name("frames.json")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        frames = {name: base64.b64encode(build(name, Path(tmp) / name)).decode() for name in BUILDERS}
    FRAMES.write_text(json.dumps(frames, indent=1) + "\n")
    print(f"{len(frames)} frames written to {FRAMES}")


if __name__ == "__main__":
    main()
