/* Money as text: the same rule as loopwatch/money.py (tests/test_money.py checks both
 * give identical strings). The number as it reads (its shortest round-trip decimal,
 * String(value)), rounded half away from zero at `decimals` places, thousands grouped
 * with commas, the sign before the dollar; a value that rounds to zero has no sign.
 * Done on the digits, not with toFixed (which rounds the binary value: 0.02175 ->
 * "0.0217") nor toLocaleString (locale-dependent). */
"use strict";

(function (root) {
  function usd(value, decimals) {
    if (typeof value !== "number" || !Number.isFinite(value)) return "–";
    const places = decimals === undefined || decimals === null ? 4 : decimals;
    const text = String(Math.abs(value));
    const m = /^(\d+)(?:\.(\d+))?(?:e([+-]\d+))?$/.exec(text);
    let digits = m[1] + (m[2] || "");
    let point = m[1].length + Number(m[3] || 0);  // digits before the decimal point
    if (point < 0) { digits = "0".repeat(-point) + digits; point = 0; }
    if (digits.length < point + places + 1) digits = digits.padEnd(point + places + 1, "0");
    const kept = digits.slice(0, point + places).split("").map(Number);
    if (Number(digits[point + places]) >= 5) {
      let i = kept.length - 1;
      while (i >= 0 && kept[i] === 9) { kept[i] = 0; i--; }
      if (i >= 0) kept[i] += 1; else { kept.unshift(1); point += 1; }
    }
    const whole = kept.slice(0, point).join("").replace(/^0+(?=\d)/, "") || "0";
    const fraction = kept.slice(point).join("");
    const grouped = whole.replace(/\B(?=(\d{3})+(?!\d))/g, ",");
    const zero = kept.every((d) => d === 0);
    return `${value < 0 && !zero ? "-" : ""}$${grouped}${places > 0 ? `.${fraction}` : ""}`;
  }
  root.loopwatchMoney = { usd };
  if (typeof module !== "undefined" && module.exports) module.exports = { usd };
})(typeof window !== "undefined" ? window : globalThis);
