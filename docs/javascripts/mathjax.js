// MathJax settings for pymdownx.arithmatex (generic mode): typeset \( \) and \[ \] spans,
// again after each instant page load of Material. MathJax itself is served with the site:
// mathjax/ beside this file holds MathJax 3.2.2's es5 tex-mml-chtml.js, the TeX extensions
// it loads on demand (input/tex/extensions/) and its CHTML fonts (output/chtml/fonts/
// woff-v2/), copied unchanged from the npm package mathjax@3.2.2 (Apache-2.0: LICENSE).
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex",
  },
};

document$.subscribe(() => {
  MathJax.startup.output.clearCache();
  MathJax.typesetClear();
  MathJax.texReset();
  MathJax.typesetPromise();
});
