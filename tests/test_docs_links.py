"""Every relative link and image of the README and docs/*.md points at a file of the repository
(figures live under docs/figures/)."""

import glob
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _relative_links(path: str) -> list[str]:
    with open(path) as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)  # code blocks hold no links
    out = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http(s):, mailto:, gs:, an anchor of the same page
        out.append(target.split("#")[0])
    return out


def test_every_relative_link_of_the_docs_resolves():
    pages = [os.path.join(REPO, "README.md"), *glob.glob(os.path.join(REPO, "docs", "*.md"))]
    broken, images = [], 0
    for page in pages:
        for target in _relative_links(page):
            resolved = os.path.normpath(os.path.join(os.path.dirname(page), target))
            images += target.endswith(".png")
            if not os.path.exists(resolved):
                broken.append(f"{os.path.relpath(page, REPO)}: {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)
    assert images >= 7  # docs/results.md's figures are checked, not skipped


def test_the_link_pattern_finds_images_and_links_and_skips_urls(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "![a](figures/a.png) [b](../README.md#x) [c](https://x.org/y) [d](#here)\n"
        "```\n[e](not/a/link.md)\n```\n"
    )
    assert _relative_links(str(page)) == ["figures/a.png", "../README.md"]
