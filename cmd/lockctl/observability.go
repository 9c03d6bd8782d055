//go:build unix

package main

import (
	"fmt"
	"log/slog"
	"net/http"
	"sync"
)

// logLevels are --log-level's values; "off" logs nothing.
var logLevels = map[string]slog.Level{"debug": slog.LevelDebug, "info": slog.LevelInfo, "warn": slog.LevelWarn, "error": slog.LevelError}

// health is what /healthz answers: the state lockctl is in, and the check
// of the session (waiting) or of the hold (holding).
type health struct {
	mu    sync.Mutex
	state string
	check func() error
}

func (hl *health) set(state string, check func() error) {
	hl.mu.Lock()
	defer hl.mu.Unlock()
	hl.state, hl.check = state, check
}

// ServeHTTP answers 200 and the state while the check passes (the session
// lives and, once holding, the hold is current), else 503 and why.
func (hl *health) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	hl.mu.Lock()
	state, check := hl.state, hl.check
	hl.mu.Unlock()
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	if check == nil {
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintln(w, "starting")
		return
	}
	if err := check(); err != nil {
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintf(w, "%s: %v\n", state, err)
		return
	}
	fmt.Fprintf(w, "ok: %s\n", state)
}

// logLevelHelp lists --log-level's values.
const logLevelHelp = "log the session's state changes on stderr at this level and above: off, debug, info, warn or error"
