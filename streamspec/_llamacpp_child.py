"""The process `streamspec.llamacpp.LlamaCppServer` runs llama.cpp's server in (run by path, so
that it imports neither torch nor streamspec: it starts in well under a second).

It reads its settings as one JSON line on stdin, starts the xllamacpp server, writes
``ADDRESS <url>`` (or ``ERROR <message>``) as one line on stdout, and stops the server when
stdin closes: when the parent's ``with`` block ends, or when the parent dies. The parent kills
this process if stopping takes too long, which is why the server does not live in the parent:
xllamacpp stops its server in the object's destructor, holding the interpreter's lock, and a
destructor that never returns would hang the parent with it.
"""

import json
import sys


def main() -> int:
    settings = json.loads(sys.stdin.readline())
    try:
        import xllamacpp as xlc

        params = xlc.CommonParams()
        params.model.path = settings["gguf"]
        params.n_ctx = settings["context"] * settings["parallel"]
        params.n_parallel = settings["parallel"]
        params.port = 0  # a free port
        params.hostnames = ["127.0.0.1"]
        params.cpuparams.n_threads = settings["threads"]
        params.cpuparams_batch.n_threads = settings["threads"]
        params.cache_prompt = True
        params.verbosity = 3 if settings["verbose"] else 0
        if settings["ram_cache_mib"] is not None:
            params.cache_ram_mib = int(settings["ram_cache_mib"])
        if settings["slot_dir"] is not None:
            params.slot_save_path = settings["slot_dir"]
        if settings["speculative"] is not None:
            params.speculative.types = [getattr(xlc.common_speculative_type, settings["speculative"])]
        server = xlc.Server(params)
        address = server.listening_address
    except Exception as err:  # reported to the parent, which raises it
        sys.stdout.write(f"ERROR {type(err).__name__}: {err}\n")
        sys.stdout.flush()
        return 1
    url = address if address.startswith("http") else f"http://{address}"
    sys.stdout.write(f"ADDRESS {url}\n")
    sys.stdout.flush()
    sys.stdin.read()  # until the parent closes it
    del server  # stops the server (the parent kills this process if that hangs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
