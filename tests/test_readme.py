"""The README's promises: a title, one sentence and two commands first, CI runs the second, the plain-PyTorch example works."""

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _code_blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_readme_starts_with_the_two_commands_and_ci_runs_the_second():
    first, second = _code_blocks("bash")[:2]
    assert README.split("\n\n", 2)[2].startswith("```bash\n" + first), "title, one sentence, then the commands"
    assert "chameleon-train" in first and "pytest" in second
    ci = (ROOT / ".ci" / "run").read_text()
    assert second.strip() in ci, ".ci/run must run the README's test command"


def test_plain_pytorch_example_runs_and_swaps(capsys):
    section = README.split("## Use it from a plain PyTorch loop", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    torch.manual_seed(0)
    exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3
    swapped = [float(re.search(r"swapped out ([\d.]+) MiB", line).group(1)) for line in lines]
    assert swapped[0] > 0, lines  # WarmUp swaps every eligible activation; later a policy swaps what the budget needs
    peaks = [float(re.search(r"peak ([\d.]+) MiB", line).group(1)) for line in lines]
    assert max(peaks) <= 64, lines


def _anchor(title: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def test_readme_opens_with_title_sentence_two_commands_then_contents():
    title, blank, sentence, blank2, rest = README.split("\n", 4)
    assert title == "# chameleon-dist" and blank == blank2 == ""
    assert sentence.endswith(".") and sentence.count(". ") == 0, "one sentence after the title"
    first, second = _code_blocks("bash")[:2]
    assert rest.startswith("```bash\n" + first + "```\n\n```bash\n" + second + "```\n")
    contents = README.split("\nContents:\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    after = README.split("\nContents:\n\n", 1)[1]
    headings = re.findall(r"^## (.+)$", after, flags=re.M)
    assert contents == [f"- [{h}](#{_anchor(h)})" for h in headings], "the contents list every ## heading, in order"
