"""Sphinx configuration of the jaxmem documentation site (``make docs``).

The JAX ecosystem's choice, as in optax, Flax and chex: Sphinx with MyST markdown pages
(myst-nb, which includes myst-parser), so the pages read the same on GitHub and on the site;
myst-nb renders the notebooks of ``notebooks/`` with the outputs saved in them (nothing is
executed at build time); autodoc reads the docstrings and napoleon their Google style; the
sphinx-book-theme. Warnings are errors (``sphinx-build -W``).
"""

import filecmp
import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
# Document the checkout being built, whatever jaxmem the environment has installed.
sys.path.insert(0, str(ROOT / "src"))

import jaxmem  # noqa: E402

project = "jaxmem"
author = "the jaxmem authors"
copyright = "the jaxmem authors"  # noqa: A001
release = version = jaxmem.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

# The notebooks live in notebooks/ at the repository root; Sphinx reads only its source folder.
# They are copied (with the figures beside them) into docs/notebooks/ at every build, a folder
# git ignores, so they are kept once in git. An unchanged file is not copied again, so an
# incremental build does not re-read it.
NOTEBOOKS_SRC, NOTEBOOKS_DST = ROOT / "notebooks", DOCS / "notebooks"


def _copy_notebooks() -> None:
    NOTEBOOKS_DST.mkdir(exist_ok=True)
    wanted = {p.name: p for p in NOTEBOOKS_SRC.glob("*") if p.suffix in (".ipynb", ".png")}
    for stale in NOTEBOOKS_DST.iterdir():
        if stale.name not in wanted:
            stale.unlink()
    for name, src in wanted.items():
        dst = NOTEBOOKS_DST / name
        if not dst.exists() or not filecmp.cmp(src, dst, shallow=False):
            shutil.copy2(src, dst)


_copy_notebooks()

exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# MyST: GitHub-style anchors for headings, so that `page.md#a-heading` links work on GitHub and
# on the site alike.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# myst-nb: show the outputs saved in the notebooks; never execute them here (CI runs them).
nb_execution_mode = "off"

# autodoc + napoleon: Google-style docstrings. Attributes as fields of their class (napoleon's
# ``.. attribute::`` entries would describe dataclass fields a second time).
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_preserve_defaults = True  # `split_rngs={"params": True}` as written, not re-parsed
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
napoleon_use_rtype = False

html_theme = "sphinx_book_theme"
html_title = f"jaxmem {release}"
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
}
# The memory viewer's page may ship static files (docs/_static/); an absent folder is no error.
html_static_path = ["_static"] if (DOCS / "_static").is_dir() else []


def _api_pages_outdated(app, env, added, changed, removed):
    """Sphinx re-reads a page when its source changes, not when a docstring it includes does:
    the API pages are read again at every build (a second or two), the notebooks are not."""
    return sorted(doc for doc in env.found_docs if doc.startswith("api/"))


def setup(app):
    app.connect("env-get-outdated", _api_pages_outdated)
