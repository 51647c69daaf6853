"""The in-sandbox end of a scaffold's channel: TCP on 127.0.0.1:PORT relayed to a UNIX socket.

    python3 -I relay.py PORT SOCKET

A sandbox has no network, but the CLIs want a TCP base URL. This script (standard library
only: it runs with the sandbox's own python3) listens on 127.0.0.1:PORT, then forks: the parent
exits once the port accepts connections (so `python3 relay.py ... && scaffold` starts the
scaffold only when its base URL answers) and the child relays every connection, byte for byte
in both directions, to the UNIX socket that the host's channel (`envs.scaffolds.channel`)
listens on, where the requests are checked and sent to the gateway. At most MAX_CONNECTIONS
connections are relayed at once (more wait in the listen queue). The child dies with the
sandbox's command (its process namespace or its sweep), which ends the episode.
"""

import os
import socket
import sys
import threading

MAX_CONNECTIONS = 32
CHUNK = 65536


def _pump(src, dst):
  """Copies src to dst until src's end, then closes dst's sending side."""
  try:
    while True:
      data = src.recv(CHUNK)
      if not data:
        break
      dst.sendall(data)
  except OSError:
    pass
  try:
    dst.shutdown(socket.SHUT_WR)
  except OSError:
    pass


def _serve(client, path, slots):
  try:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
      upstream.connect(path)
    except OSError:
      upstream.close()
      client.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
      return
    back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
    back.start()
    _pump(client, upstream)
    back.join()
    upstream.close()
  except OSError:
    pass
  finally:
    client.close()
    slots.release()


def main(argv):
  if len(argv) != 3 or not argv[1].isdigit():
    sys.stderr.write("usage: relay.py PORT SOCKET\n")
    return 2
  port, path = int(argv[1]), argv[2]
  server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  server.bind(("127.0.0.1", port))
  server.listen(128)
  if os.fork():
    return 0  # listening already: the caller may connect
  os.setsid()
  for fd in (0, 1, 2):  # the caller's pipes must not wait for this process
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, fd)
    os.close(devnull)
  slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
  while True:
    slots.acquire()
    client, _ = server.accept()
    threading.Thread(target=_serve, args=(client, path, slots), daemon=True).start()


if __name__ == "__main__":
  sys.exit(main(sys.argv))
