"""The operator's side of the edge (deploy/edge.py): a forwarder on the operator's own machine that
listens on 127.0.0.1 and carries each connection to the edge over TLS, presenting the operator's
client certificate, which the edge asks of every Control API request.

The CLI of Flower 1.41 and 1.42 cannot present a client certificate itself (its HTTP client takes only root
certificates, ``flwr/supercore/protobuf/client.py``), so ``flwr`` speaks plain HTTP to this
forwarder on loopback, and the forwarder speaks mutual TLS to the edge, checking the edge's
certificate against the deployment's CA:

    python deploy/operator_tunnel.py --edge superlink.example.org:9443 --listen 127.0.0.1:9093 \\
        --credentials deploy/credentials        # ca.crt, operator.crt, operator.key
    # ~/.flwr/config.toml:  [superlink.federation]  address = "127.0.0.1:9093"  insecure = true
    flwr run . federation --stream

Standard library only; stops on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import ssl
from pathlib import Path


def client_context(credentials: Path) -> ssl.SSLContext:
    """TLS to the edge: its certificate checked against the deployment's CA, the operator's presented."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(credentials / "ca.crt"))
    context.load_cert_chain(str(credentials / "operator.crt"), str(credentials / "operator.key"))
    return context


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        writer.close()


async def serve(listen: tuple[str, int], edge: tuple[str, int], server_name: str, context: ssl.SSLContext,
                started: asyncio.Event | None = None) -> None:
    """Forward every connection to ``listen`` to ``edge`` until cancelled."""

    async def forward(local_reader: asyncio.StreamReader, local_writer: asyncio.StreamWriter) -> None:
        try:
            remote_reader, remote_writer = await asyncio.wait_for(
                asyncio.open_connection(*edge, ssl=context, server_hostname=server_name), timeout=30)
        except (OSError, ssl.SSLError, asyncio.TimeoutError) as err:
            print(f"operator tunnel: cannot reach the edge at {edge[0]}:{edge[1]}: {err}", flush=True)
            local_writer.close()
            return
        await asyncio.gather(_pipe(local_reader, remote_writer), _pipe(remote_reader, local_writer))

    server = await asyncio.start_server(forward, *listen)
    async with server:
        if started is not None:
            started.set()
        await server.serve_forever()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--edge", required=True, help="the edge's host:port")
    parser.add_argument("--listen", default="127.0.0.1:9093", help="where flwr connects (keep it on loopback)")
    parser.add_argument("--credentials", type=Path, required=True, help="ca.crt, operator.crt, operator.key")
    parser.add_argument("--server-name", help="the name the edge's certificate must carry (default: the edge's host)")
    args = parser.parse_args()
    edge = _address(args.edge)
    context = client_context(args.credentials)

    async def run() -> None:
        task = asyncio.create_task(serve(_address(args.listen), edge, args.server_name or edge[0], context))
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, task.cancel)
        print(f"operator tunnel: {args.listen} -> {args.edge} (mutual TLS)", flush=True)
        try:
            await task
        except asyncio.CancelledError:
            pass

    asyncio.run(run())


if __name__ == "__main__":
    main()
