import hashlib
import os

APP = os.environ["APP_DIR"]
PAYLOAD = bytes((i * 37 + 11) % 256 for i in range(5000))


def test_payload_unchanged():
  with open(os.path.join(APP, "data", "payload.bin"), "rb") as f:
    assert f.read() == PAYLOAD


def test_checksum_file():
  with open(os.path.join(APP, "checksum.txt")) as f:
    assert f.read() == hashlib.sha256(PAYLOAD).hexdigest() + "\n"
