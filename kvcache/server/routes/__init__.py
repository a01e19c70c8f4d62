"""The API's routes, one APIRouter per concern, each handler reading the app's ServerState (server/state.py):
info.py (health, metrics, models), tokens.py (tokenize, detokenize), generate.py (completions and chat). The KV
page's routes are server/kv_page.py's."""
