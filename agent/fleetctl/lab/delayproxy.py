"""A TCP forwarder that adds latency: every chunk is held D ms in each direction.

The lab's kernels have no `netem` qdisc, so each lab host's sshd sits behind one of these
(`python delayproxy.py --listen 10.213.0.11:22 --connect 127.0.0.1:22 --delay-file F`).
The delay in milliseconds is read from the delay file at start and again on SIGHUP, so it
changes without dropping connections. Chunks are not serialised: each one leaves at its own
arrival time + D, so this is latency, not a bandwidth cap. Stdlib only.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path

CHUNK = 65536


class Delay:
    """The current one-way delay in seconds, reloaded from `path` (integer milliseconds)."""

    def __init__(self, path: Path | None):
        self.path = path
        self.seconds = 0.0
        self.reload()

    def reload(self) -> None:
        """Read the delay file; a missing or empty file means no delay."""
        try:
            text = self.path.read_text().strip() if self.path else ""
        except FileNotFoundError:
            text = ""
        self.seconds = max(0.0, float(text or 0) / 1000.0)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: Delay) -> None:
    """Copy reader -> writer; each chunk is written at its arrival time + delay."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    async def send() -> None:
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if data is None:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    sender = asyncio.create_task(send())
    try:
        while True:
            data = await reader.read(CHUNK)
            queue.put_nowait((loop.time() + delay.seconds, data or None))
            if not data:
                break
        await sender
    finally:
        sender.cancel()


async def _handle(client_r, client_w, target: tuple[str, int], delay: Delay) -> None:
    try:
        server_r, server_w = await asyncio.open_connection(*target)
    except OSError:
        client_w.close()
        return
    pumps = [asyncio.create_task(_pump(client_r, server_w, delay)),
             asyncio.create_task(_pump(server_r, client_w, delay))]
    try:
        await asyncio.gather(*pumps)
    except (OSError, asyncio.CancelledError):
        pass
    finally:
        for p in pumps:
            p.cancel()
        client_w.close()
        server_w.close()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def serve(listen: tuple[str, int], target: tuple[str, int], delay_file: Path | None) -> None:
    """Forward connections on `listen` (host, port) to `target`, forever; SIGHUP reloads the delay."""
    delay = Delay(delay_file)
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, delay.reload)
    server = await asyncio.start_server(
        lambda r, w: _handle(r, w, target, delay), *listen, reuse_address=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    """Command line: --listen HOST:PORT --connect HOST:PORT [--delay-file PATH]."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen", type=_addr, required=True)
    p.add_argument("--connect", type=_addr, required=True)
    p.add_argument("--delay-file", type=Path)
    a = p.parse_args(argv)
    asyncio.run(serve(a.listen, a.connect, a.delay_file))


if __name__ == "__main__":
    main()
