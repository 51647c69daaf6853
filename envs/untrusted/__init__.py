"""Reading what hostile datasets and network clients send, within bounds.

  decode   JSON whose nesting is measured before it is parsed (`loads`, `check_depth`) and
           zlib data inflated up to a byte cap (`inflate`): dataset loaders and request bodies.
  door     the HTTP front door both servers run (`Door`): header and body deadlines, the TLS
           handshake deadline, body size caps, and a connection cap that closes idle
           tokenless connections first.

Errors are ValueError subclasses naming the field or limit (`TooDeep`, `TooLarge`), or a
`door.RequestError` carrying the HTTP status.
"""

from envs.untrusted.decode import (MAX_JSON_DEPTH, TooDeep, TooLarge, check_depth, inflate,
                                   loads, nesting_bound)
