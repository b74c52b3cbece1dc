"""The process `streamspec.llamacpp.LlamaCppServer` runs llama.cpp's server in (run by path, so
that it imports neither torch nor streamspec: it starts in well under a second).

It reads its settings as one JSON line on stdin, starts the xllamacpp server, writes
``ADDRESS <url>`` (or ``ERROR <message>``) as one line on stdout, and stops the server when
stdin closes: when the parent's ``with`` block ends, or when the parent dies. It stops by
ending the process (``os._exit``): xllamacpp stops its server in the object's destructor, holding
the interpreter's lock, and that destructor sometimes never returns (seen in a CI run: a child
killed after the parent's 60 s); the server holds nothing a process's end does not release (its
slot files live in the parent's temporary folder). The parent still kills this process if it
does not end in time, and the server does not live in the parent, whose own exit would hang.
"""

import json
import os
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
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the server ends with the process, never waited on in its destructor


if __name__ == "__main__":
    sys.exit(main())
