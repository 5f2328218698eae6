// clawloop's OpenClaw plugin. It owns the provider id "clawloop" (configured under models.providers.clawloop, e.g. by
// `clawloop openclaw-config`) and adds, to every model request OpenClaw sends it:
//   X-Session-Id: OpenClaw's session id, so clawloop needs no inference to find the conversation;
//   X-Turn-Type: side while OpenClaw compacts that session (summaries are housekeeping, never trained).
// When OpenClaw ends a session it tells clawloop (POST /v1/sessions/{id}/end), so the last answer is closed
// instead of waiting for the idle timeout. clawloop's own recognition of OpenClaw traffic stays in force: this only
// makes it explicit. See docs/openclaw.md.

const PROVIDER = "clawloop";
const compacting = new Set();

function providerSettings(config) {
  const p = config?.models?.providers?.[PROVIDER];
  if (!p?.baseUrl) return null;
  let key = typeof p.apiKey === "string" ? p.apiKey : "";
  const ref = /^\$\{([A-Z0-9_]+)\}$/.exec(key);
  if (ref) key = process.env[ref[1]] ?? "";
  return { baseUrl: p.baseUrl.replace(/\/+$/, ""), apiKey: key };
}

export default {
  id: "clawloop",
  name: "clawloop",
  description: "Session headers for a clawloop provider.",
  register(api) {
    api.registerProvider({
      id: PROVIDER,
      label: "clawloop",
      auth: [],
      resolveTransportTurnState(ctx) {
        const headers = {};
        if (ctx.sessionId) {
          headers["X-Session-Id"] = ctx.sessionId;
          if (compacting.has(ctx.sessionId)) headers["X-Turn-Type"] = "side";
        }
        return { headers };
      },
    });
    api.on("before_compaction", (_event, ctx) => {
      if (ctx?.sessionId) compacting.add(ctx.sessionId);
    });
    api.on("after_compaction", (_event, ctx) => {
      if (ctx?.sessionId) compacting.delete(ctx.sessionId);
    });
    api.on("session_end", async (_event, ctx) => {
      const settings = providerSettings(api.config);
      if (!settings || !ctx?.sessionId) return;
      compacting.delete(ctx.sessionId);
      const headers = settings.apiKey ? { Authorization: `Bearer ${settings.apiKey}` } : {};
      try {
        await fetch(`${settings.baseUrl}/sessions/${encodeURIComponent(ctx.sessionId)}/end`, { method: "POST", headers });
      } catch (err) {
        api.logger?.warn?.(`clawloop: could not end session ${ctx.sessionId}: ${err}`);
      }
    });
  },
};
