"""Where the CPU goes per chunk of hidden states when the cache writes one (no GPU).

Encodes 8B-shaped chunks (256 tokens x 5 layers x 4096, Gaussian bf16 bits) one at a time
in this process and reports CPU milliseconds per chunk of the cache's compression on its
own (blosc's byte shuffle + zstd 1 in 512 KiB blocks), against a whole zarr write of the
same chunks (``array[a:b] = x``: zarr's pipeline, checksum, file), sequential and with
zarr's concurrency as the worker sets it, and, where the ``zarrs`` package is installed,
the same writes through its Rust codec pipeline (checked to read back).

    python bench/chunk_cpu.py --chunks 32 --work /tmp/chunk_cpu
"""

from __future__ import annotations

import argparse
import json
import shutil
import time

import numpy as np
import torch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--chunks", type=int, default=32)
    p.add_argument("--work", default="/tmp/chunk_cpu")
    p.add_argument("--concurrency", default="1,32")
    args = p.parse_args()
    import zarr
    from numcodecs import Blosc

    from dflash.shared import cache as C

    Blosc.use_threads = False
    C_TOK, L, D = 256, 5, 4096
    bits = C.bf16_to_bits(torch.randn(args.chunks * C_TOK, L, D, generator=torch.Generator().manual_seed(0)).bfloat16())
    chunks = [bits[i * C_TOK:(i + 1) * C_TOK] for i in range(args.chunks)]
    blosc = Blosc("zstd", 1, Blosc.SHUFFLE, blocksize=C.BLOSC_BLOCKSIZE, typesize=2)
    mb = bits.nbytes / 1e6
    out = {"chunks": args.chunks, "chunk_MB": round(chunks[0].nbytes / 1e6, 2)}

    def per_chunk(fn):
        c0 = time.process_time()
        t0 = time.perf_counter()
        r = fn()
        return round((time.process_time() - c0) * 1e3 / args.chunks, 2), round(mb / (time.perf_counter() - t0)), r

    out["blosc_ms"], out["blosc_MB_s"], encoded = per_chunk(lambda: [blosc.encode(c) for c in chunks])
    out["ratio"] = round(bits.nbytes / sum(len(e) for e in encoded), 4)
    out["copy_ms"], _, _ = per_chunk(lambda: [np.array(c) for c in chunks])

    def hidden_array(path: str):
        """A fresh array of the cache's hidden-state layout and codecs at ``path``."""
        shutil.rmtree(path, ignore_errors=True)
        return zarr.open_group(path, mode="w").create_array("h", shape=bits.shape, chunks=(C_TOK, L, D), dtype="uint16",
                                                            fill_value=0, compressors=C._compressors(2, 1))

    written = []
    for conc in (int(x) for x in args.concurrency.split(",")):
        with zarr.config.set({"async.concurrency": conc, "array.write_empty_chunks": True}):
            a = hidden_array(f"{args.work}/c{conc}.zarr")
            out[f"zarr_conc{conc}_ms"], out[f"zarr_conc{conc}_MB_s"], _ = per_chunk(lambda: a.__setitem__(slice(None), bits))
        written.append(f"{args.work}/c{conc}.zarr")
    try:
        import zarrs  # noqa: F401
    except ImportError:
        zarrs = None
    if zarrs is not None:
        path = f"{args.work}/zarrs.zarr"
        with zarr.config.set({"codec_pipeline.path": "zarrs.ZarrsCodecPipeline", "array.write_empty_chunks": True}):
            a = hidden_array(path)
            out["zarrs_ms"], out["zarrs_MB_s"], _ = per_chunk(lambda: a.__setitem__(slice(None), bits))
        out["zarrs_reads_back"] = bool(np.array_equal(zarr.open_group(path, mode="r")["h"][:], bits))
        written.append(path)
    for p in written:
        shutil.rmtree(p, ignore_errors=True)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
