// Copy buttons: <button class="copy" data-copy="ID"> copies the text of the element with that id.
(function () {
  for (const button of document.querySelectorAll("button.copy")) {
    button.addEventListener("click", () => {
      const text = document.getElementById(button.dataset.copy).textContent;
      const done = () => { button.textContent = "Copied"; setTimeout(() => { button.textContent = "Copy"; }, 2000); };
      if (navigator.clipboard && window.isSecureContext) {
        navigator.clipboard.writeText(text).then(done, () => { button.textContent = "Select and copy"; });
      } else {  // plain http off loopback: the clipboard API is not offered there
        const range = document.createRange();
        range.selectNodeContents(document.getElementById(button.dataset.copy));
        window.getSelection().removeAllRanges();
        window.getSelection().addRange(range);
        button.textContent = document.execCommand("copy") ? "Copied" : "Press Ctrl-C";
      }
    });
  }
})();
