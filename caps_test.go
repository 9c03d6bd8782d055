package etcdsync

// What a client learns about its servers (caps), without a server: when a
// progress answer may confirm a turn, and when a wait asks again.

import (
	"testing"
	"time"
)

// Progress answers are trusted from release 3.6.0 on. Servers before the
// fix of etcd#15220 read; so do 3.5 releases with the fix (a client is
// judged once, and a 3.5 member before 3.5.8 could go unseen), 3.4 whatever
// its patch, and pre-releases.
func TestCapsProgressOrderedFromTheFix(t *testing.T) {
	t.Parallel()
	for v, want := range map[string]bool{
		// Before the fix: a read per handoff.
		"3.3.27": false, "3.4.0": false, "3.4.23": false, "3.4.24": false,
		"3.5.0": false, "3.5.7": false, "3.5.7-rc.0": false,
		// The fix in 3.4 and 3.5 lines: still a read (see progressOrdered).
		"3.4.25": false, "3.4.37": false, "3.5.8": false, "3.5.17": false, "3.5.35": false,
		// Releases from 3.6.0: a progress request.
		"3.6.0": true, "3.6.16": true, "3.7.3": true, "4.0.0": true,
		// Pre-releases: read.
		"3.6.0-alpha.0": false, "3.6.0-rc.1": false,
		// Not a version: read.
		"": false, "3": false, "x.y.z": false, "3.5": false, "3.6": false, "3.5.x": false, "3.5.8-rc.0": false, "2.3.8": false,
	} {
		if got := progressOrdered(v); got != want {
			t.Errorf("progressOrdered(%q) = %v, want %v", v, got, want)
		}
	}
}

func TestCapsUnansweredUntilAProbeIsAnswered(t *testing.T) {
	t.Parallel()
	var c caps
	c.state.Store(capsProgress)
	if !c.probing() {
		t.Fatal("a client with no answer yet: its waits probe")
	}
	c.unanswered()
	if !c.cached() || c.state.Load() != capsUnanswered {
		t.Fatal("an unanswered request marks a client that never answered")
	}
	if c.probing() {
		t.Fatal("a marked client probes again only after reprobeAfter")
	}
	c.reprobe.Store(time.Now().Add(-time.Second).UnixNano()) // reprobeAfter has passed
	if !c.probing() {
		t.Fatal("a marked client probes again once reprobeAfter has passed")
	}
	if c.probing() {
		t.Fatal("one wait per reprobeAfter probes a marked client")
	}
	c.answer()
	if c.cached() || c.state.Load() != capsProgress {
		t.Fatal("an answered probe clears the mark")
	}
	if c.probing() {
		t.Fatal("a client that answered: its waits do not probe")
	}
	c.unanswered()
	if c.state.Load() != capsProgress {
		t.Fatal("a late answer does not mark a client that answered before")
	}
}

func TestCapsOldServerNeverAsks(t *testing.T) {
	t.Parallel()
	var c caps
	c.state.Store(capsOldServer)
	c.unanswered()
	if c.probing() || c.cached() || c.state.Load() != capsOldServer {
		t.Fatal("a client of servers released before the fix of etcd#15220 reads, and is never marked or probed")
	}
}
