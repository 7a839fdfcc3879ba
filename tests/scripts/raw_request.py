"""Sends one unary request of raw bytes, well-formed or not, to a method of tracer's service and
prints its outcome as JSON: ["OK", response hex] or [status code, details].
Usage: raw_request.py SOCKET METHOD REQUEST_HEX
The request's bytes may hold the five bytes b"CHILD": they become the pid, as a five-byte varint
(so lengths around it hold), of a child this script forks first, which sleeps 2 s and exits
without an exec (a client's own child, held by nothing), or after 5 s execs the JSON argv in
RAW_CHILD_EXEC."""
import json
import os
import sys
import time

import grpc


def main():
    socket, method, request = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
    child = None
    if b"CHILD" in request:
        # Before grpc starts its threads.
        child = os.fork()
        if child == 0:
            # RAW_CHILD_EXEC (a JSON argv): the child then execs it, as a launcher would,
            # once the request surely was answered.
            argv = os.environ.get("RAW_CHILD_EXEC")
            time.sleep(5 if argv else 2)
            if argv:
                argv = json.loads(argv)
                os.execv(argv[0], argv)
            os._exit(0)
        request = request.replace(b"CHILD", bytes([(child >> s) & 0x7F | 0x80 for s in (0, 7, 14, 21)] + [child >> 28]))
    # grpcio sends the socket path as :authority, which hyper rejects; any host name does.
    channel = grpc.insecure_channel(f"unix:{socket}", options=[("grpc.default_authority", "localhost")])
    rpc = channel.unary_unary(f"/tracer.v1.Tracer/{method}", request_serializer=None, response_deserializer=None)
    try:
        out = ["OK", rpc(request, timeout=20).hex()]
    except grpc.RpcError as e:
        out = [e.code().name, e.details()]
    print(json.dumps(out))
    if child:
        os.waitpid(child, 0)


if __name__ == "__main__":
    main()
