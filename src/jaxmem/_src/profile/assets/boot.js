/*
 * The memory viewer's boot script: runs first and turns any error of the viewer into a visible
 * banner (the browser still logs it). Written inline by jaxmem/_src/profile/html.py.
 */
window.addEventListener("error", function (event) {
  var box = document.getElementById("viewer-error");
  if (!box) {
    box = document.createElement("div");
    box.id = "viewer-error";
    box.className = "viewer-error";
    (document.body || document.documentElement).prepend(box);
  }
  box.textContent = "The memory viewer failed: " + (event.message || "an error") +
    ". Its data is in this file's jaxmem-data block.";
});
