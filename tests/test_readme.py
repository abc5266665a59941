"""The README runs as written: every ``python`` block executes, and its test command is CI's.

Blocks that load a model by its Hub name (``from_pretrained("bert-base-uncased")``,
``SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")``) run here with the name replaced
by a folder holding a tiny model of the same kind with random weights and a small tokenizer, built
in the test (no download: the Hub is switched off while the blocks run). A Hub name in a block with
no tiny stand-in below fails the test rather than downloading. A block that calls
``http://localhost:8080`` (a client of ``python -m ragged.serve``) runs against a real server of a
tiny model started for it (where the serve extra is installed).
"""

from __future__ import annotations

import pathlib
import re
import string

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
# A quoted Hub name as the first argument of a loading call.
HUB_NAME = re.compile(r"""(?:from_pretrained|SentenceTransformer)\(\s*(?:name\s*=\s*)?["']([\w.-]+/?[\w.-]*)["']""")
NAME_ASSIGNED = re.compile(r"""^\s*name\s*=\s*["']([\w.-]+/[\w.-]+|[\w.-]+-[\w.-]+)["']""", re.MULTILINE)


def _blocks(lang: str) -> list[tuple[str, str]]:
    """(heading above the block, body) of each ``lang`` block."""
    out = []
    for match in BLOCK.finditer(README):
        if match.group(1) == lang:
            heads = re.findall(r"^#+ (.+)$", README[: match.start()], re.MULTILINE)
            out.append((heads[-1] if heads else "", match.group(2)))
    return out


PYTHON_BLOCKS = _blocks("python")


def _hub_names(code: str) -> set[str]:
    return set(HUB_NAME.findall(code)) | set(NAME_ASSIGNED.findall(code))


# --------------------------------------------------------------------------------------
# tiny stand-ins for the Hub models the README names

WORDS = (  # noqa: SIM905  (one string reads better than 120 quoted words)
    "the a an of and to in is it that was for on are with as be at this from or by but what some we can out "
    "other all there when up use how said each which do their time if will way about many then them would "
    "like so these long make thing see two has look more day could go come did first who may down side been "
    "now find good bad film short text longer example few words second hour too"
).split()
VOCAB = (
    ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    + list(string.ascii_lowercase + string.digits + ".,!?'")
    + ["##" + c for c in string.ascii_lowercase + string.digits]
    + WORDS
)
D = 32


def _tokenizer(folder: pathlib.Path):
    import transformers as tf

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    tf.BertTokenizerFast(str(folder / "vocab.txt"), model_max_length=128).save_pretrained(str(folder))


def _bert_config(**kw):
    import transformers as tf

    return tf.BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * D,
        max_position_embeddings=128,
        **kw,
    )


def _tiny_sentence_transformer(folder: pathlib.Path) -> None:
    import transformers as tf
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    _tokenizer(folder / "encoder")
    tf.BertModel(_bert_config()).save_pretrained(str(folder / "encoder"))
    st = SentenceTransformer(
        modules=[modules.Transformer(str(folder / "encoder")), modules.Pooling(D, "mean"), modules.Normalize()],
        device="cpu",
    )
    st.save(str(folder))


def _tiny_bert_classifier(folder: pathlib.Path) -> None:
    import transformers as tf

    _tokenizer(folder)
    tf.BertForSequenceClassification(_bert_config(num_labels=2)).save_pretrained(str(folder))


def _tiny_causal_lm(folder: pathlib.Path) -> None:
    import transformers as tf

    _tokenizer(folder)
    config = tf.Qwen2Config(
        vocab_size=len(VOCAB),
        hidden_size=D,
        intermediate_size=2 * D,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    tf.Qwen2ForCausalLM(config).save_pretrained(str(folder))


STAND_INS = {
    "sentence-transformers/all-MiniLM-L6-v2": _tiny_sentence_transformer,
    "bert-base-uncased": _tiny_bert_classifier,
    "Qwen/Qwen2.5-0.5B": _tiny_causal_lm,
}


SERVER_URL = "http://localhost:8080"  # where the README's client blocks find python -m ragged.serve


def _ids(blocks):
    return [f"{i}-{re.sub(r'[^a-z0-9]+', '-', head.lower()).strip('-')[:40]}" for i, (head, _) in enumerate(blocks)]


# --------------------------------------------------------------------------------------


def test_readme_has_python_blocks():
    assert PYTHON_BLOCKS, "README.md has no python code block"


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)), ids=_ids(PYTHON_BLOCKS))
def test_readme_python_block_runs(index, tmp_path, monkeypatch):
    """Each block in a fresh namespace, as a user pasting it into a new interpreter, in an empty
    folder (what it writes stays there)."""
    code = PYTHON_BLOCKS[index][1]
    for module in ("transformers", "sentence_transformers"):
        if re.search(rf"^\s*(import|from) {module}\b", code, re.MULTILINE):
            pytest.importorskip(module)
    names = _hub_names(code)
    missing = names - set(STAND_INS)
    assert not missing, f"README python block {index} loads {sorted(missing)}: add a tiny stand-in to STAND_INS"
    for name in sorted(names):
        folder = tmp_path / "models" / name.replace("/", "--")
        folder.mkdir(parents=True)
        STAND_INS[name](folder)
        code = code.replace(f'"{name}"', repr(str(folder)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    server = None
    if SERVER_URL in code:  # a client of python -m ragged.serve: a real server of a tiny model
        pytest.importorskip("starlette")
        pytest.importorskip("uvicorn")
        from test_serve import Server

        folder = tmp_path / "models" / "served"
        folder.mkdir(parents=True)
        _tiny_sentence_transformer(folder)
        server = Server(str(folder))
        code = code.replace(SERVER_URL, server.url)
    try:
        exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "__readme__"})  # noqa: S102
    finally:
        if server is not None:
            server.stop()


def test_stand_ins_replace_every_hub_name():
    """The stand-in check reads the names of the calls the README uses."""
    code = (
        'm = SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")\n'
        'name = "bert-base-uncased"\nAutoModel.from_pretrained(name, num_labels=2)\n'
        'AutoModelForCausalLM.from_pretrained("Qwen/Qwen2.5-0.5B", attn_implementation="ragged")\n'
        'AutoModel.from_pretrained("org/other-model")\n'
    )
    assert _hub_names(code) == {
        "sentence-transformers/all-MiniLM-L6-v2",
        "bert-base-uncased",
        "Qwen/Qwen2.5-0.5B",
        "org/other-model",
    }


def test_readme_test_command_is_what_ci_runs():
    """The README's test command (the line that runs pytest) appears as such in .ci/run."""
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [
        line.strip()
        for _, body in _blocks("bash")
        for line in body.splitlines()
        if "pytest" in line and " && " in line and not line.strip().startswith("#")
    ]
    assert commands, "README.md gives no test command"
    for command in commands:
        install, _, run = command.partition(" && ")
        extras = re.search(r'-e "\.\[([^\]]*)\]"', install)
        assert extras, f"README test command installs no extras: {command!r}"
        assert f'-e ".[{extras.group(1)}]"' in ci, f".ci/run installs other extras than {command!r}"
        assert run.replace("python ", "python3 ") in ci, f".ci/run does not run {run!r}"


def test_readme_lines_are_readable():
    """No line runs over 300 characters (a table cell of a thousand is no documentation)."""
    long = [(n, len(line)) for n, line in enumerate(README.splitlines(), 1) if len(line) > 300]
    assert not long, f"README.md lines over 300 characters (line, length): {long}"


def test_readme_leads_with_its_uses():
    """Install, then the uses (each with a runnable snippet), then the reference material."""
    heads = re.findall(r"^(#+) (.+)$", README, re.MULTILINE)
    top = [h for level, h in heads if level == "##"]
    assert top[:2] == ["Install", "Uses"], top
    uses = README.split("\n## Uses\n", 1)[1].split("\n## ", 1)[0]
    sections = re.split(r"^### ", uses, flags=re.MULTILINE)[1:]
    assert len(sections) >= 4, [s.splitlines()[0] for s in sections]
    for section in sections:
        assert "```python\n" in section, f"use without a snippet: {section.splitlines()[0]}"
    for want in ("SentenceTransformer", "RaggedTrainer", "TransformerEncoder", "varlen_attention"):
        assert want in uses, f"the Uses section shows no {want}"


def test_readme_states_the_measured_test_time():
    """The README says how long its test command took, on how many cores, and whether the machine
    was idle (the figure it gave before was an idle machine's, which no user had)."""
    assert "\n## Tests\n" in README, "README.md has no Tests section"
    section = " ".join(README.split("\n## Tests\n", 1)[1].split("\n## ", 1)[0].split())
    assert re.search(r"this command took \d+ min \d+ s of wall time", section), "no measured time for the command"
    assert "2 CPU cores" in section and "idle" in section, "no machine for the time"
    assert re.search(r"`-m slow`\)? took \d+ min", section), "no time for the tests the command leaves out"
