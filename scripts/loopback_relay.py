#!/usr/bin/env python3
"""The machine's floor for any proxy: loopback round trips, direct and through a byte relay.

usage: loopback_relay.py [ROUND_TRIPS]

Three processes on 127.0.0.1: an echo server, a relay that copies bytes both ways and does
nothing else, and this client, which sends one byte and waits for it to come back, ROUND_TRIPS
times (default 20000) straight to the echo server and as many times through the relay. The
difference of the p50 round trips is what one extra process hop costs here (two more socket
writes and wake-ups), before any HTTP parsing, JSON or scheduling. Everything binds to
port 0 and stops when the client is done.
"""

import os
import select
import socket
import sys
import time


def listener():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(2)
    return s


def nodelay(conn):
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def echo(server, connections):
    for _ in range(connections):
        conn = nodelay(server.accept()[0])
        while data := conn.recv(64):
            conn.sendall(data)
    os._exit(0)


def relay(server, upstream_port):
    client = nodelay(server.accept()[0])
    upstream = nodelay(socket.create_connection(("127.0.0.1", upstream_port)))
    while True:
        for ready in select.select([client, upstream], [], [])[0]:
            data = ready.recv(64)
            if not data:
                os._exit(0)
            (upstream if ready is client else client).sendall(data)


def p50_round_trip_us(port, n):
    conn = nodelay(socket.create_connection(("127.0.0.1", port)))
    times = []
    for _ in range(n):
        start = time.perf_counter()
        conn.sendall(b"x")
        conn.recv(64)
        times.append(time.perf_counter() - start)
    conn.close()
    times.sort()
    return times[n // 2] * 1e6


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    echo_server, relay_server = listener(), listener()
    echo_port = echo_server.getsockname()[1]
    if os.fork() == 0:
        echo(echo_server, 2)
    if os.fork() == 0:
        relay(relay_server, echo_port)
    via_relay = p50_round_trip_us(relay_server.getsockname()[1], n)
    direct = p50_round_trip_us(echo_port, n)
    for _ in range(2):
        os.wait()
    print(
        f"loopback round trip p50: direct {direct:.0f} µs, through a byte relay {via_relay:.0f} µs "
        f"(one extra hop: {via_relay - direct:+.0f} µs)"
    )


if __name__ == "__main__":
    main()
