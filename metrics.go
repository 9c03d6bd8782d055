package etcdsync

// Observability: a session reports its state changes to an optional
// slog.Logger (WithLogger) and to optional Prometheus collectors
// (WithMetrics), through one interface the core owns (type reports, at the
// end): the core never calls the reporting code any other way. Unset, a
// report is one nil check: nothing is allocated, timed or started for it.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcdsync/etcdsync/internal/queue"
)

// Metrics are the Prometheus collectors that sessions made WithMetrics
// report to. One Metrics serves any number of sessions; see NewMetrics for
// the metric names.
type Metrics struct {
	acquireWait     *prometheus.HistogramVec // kind
	holdSeconds     *prometheus.HistogramVec // kind
	holdsLost       *prometheus.CounterVec   // kind, cause
	acquireErrors   *prometheus.CounterVec   // kind, reason
	keepaliveRTT    prometheus.Histogram
	lateness        prometheus.Histogram
	sessionsExpired *prometheus.CounterVec // cause
	shardErrors     prometheus.Counter
	margin          *marginCollector
}

// NewMetrics makes the collectors and registers them with reg:
//
//   - etcdsync_acquire_wait_seconds{kind}: how long each successful acquire
//     (Lock, RLock, Campaign, Acquire, and their Try forms) took;
//   - etcdsync_hold_seconds{kind}: how long each hold lasted, released or lost;
//   - etcdsync_holds_lost_total{kind,cause}: holds that ended otherwise than
//     by their release; cause is lost_contact (no keepalive acknowledged
//     within the TTL), lease_gone (the server expired or revoked the
//     lease), key_deleted (someone deleted the key), session_closed (Close,
//     Orphan, the client closed or the session's context ended while held);
//   - etcdsync_acquire_errors_total{kind,reason}: failed acquires; reason is
//     locked (a Try on a held name), canceled (the caller's context ended),
//     session_ended (or the waiter's own key vanished), invalid (a key in the
//     queue breaks the rule: a Semaphore of another capacity), etcd (an RPC
//     failed);
//   - etcdsync_keepalive_rtt_seconds: from a keepalive's send to its
//     acknowledgement;
//   - etcdsync_session_lateness_seconds: how late a session's keepalive
//     loop ran when a beat or its deadline was due (a process short of CPU,
//     a GC-bound heap); past the slack (WithSlack), a holder could learn of
//     a loss after the next holder took over;
//   - etcdsync_session_deadline_margin_seconds: at scrape time, the least
//     time left before a live session's local deadline (absent with no
//     live session); below a third of the TTL, keepalives are late;
//   - etcdsync_sessions_expired_total{cause}: sessions that ended on their
//     own (lost_contact, lease_gone), not by Close;
//   - etcdsync_shard_errors_total: errors a Shards' function returned while
//     its shard was held (it then runs again after a pause).
//
// kind is mutex, election, rwmutex, semaphore, multilock (one hold per
// name) or group (a Group's membership is a hold); there is no per-name
// label.
// Registering in a registry that already has these collectors (a second
// NewMetrics on it) returns Metrics that share them; a collector of another
// type under one of these names is an error wrapping ErrInvalidArgument. A
// nil reg is an error wrapping ErrInvalidArgument.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	if reg == nil {
		return nil, fmt.Errorf("%w: nil prometheus.Registerer", ErrInvalidArgument)
	}
	m := &Metrics{
		acquireWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "etcdsync_acquire_wait_seconds", Help: "Time from an acquire's call to its hold, for acquires that held.",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 10)}, []string{"kind"}),
		holdSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "etcdsync_hold_seconds", Help: "How long holds lasted, released or lost.",
			Buckets: prometheus.ExponentialBuckets(0.01, 4, 10)}, []string{"kind"}),
		holdsLost: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "etcdsync_holds_lost_total", Help: "Holds that ended otherwise than by their release, by cause."}, []string{"kind", "cause"}),
		acquireErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "etcdsync_acquire_errors_total", Help: "Acquires that failed, by reason."}, []string{"kind", "reason"}),
		keepaliveRTT: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "etcdsync_keepalive_rtt_seconds", Help: "Time from a keepalive's send to its acknowledgement.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14)}),
		lateness: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "etcdsync_session_lateness_seconds", Help: "How late a session's keepalive loop ran when a beat or its deadline was due.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 14)}),
		sessionsExpired: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "etcdsync_sessions_expired_total", Help: "Sessions that ended on their own (not by Close), by cause."}, []string{"cause"}),
		shardErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "etcdsync_shard_errors_total", Help: "Errors a Shards' function returned while its shard was held."}),
		margin: &marginCollector{sessions: make(map[*queue.Session]struct{}), desc: prometheus.NewDesc(
			"etcdsync_session_deadline_margin_seconds", "Least time left before a live session's local deadline.", nil, nil)},
	}
	var err error
	m.acquireWait, err = register(reg, m.acquireWait, err)
	m.holdSeconds, err = register(reg, m.holdSeconds, err)
	m.holdsLost, err = register(reg, m.holdsLost, err)
	m.acquireErrors, err = register(reg, m.acquireErrors, err)
	m.keepaliveRTT, err = register(reg, m.keepaliveRTT, err)
	m.lateness, err = register(reg, m.lateness, err)
	m.sessionsExpired, err = register(reg, m.sessionsExpired, err)
	m.shardErrors, err = register(reg, m.shardErrors, err)
	m.margin, err = register(reg, m.margin, err)
	if err != nil {
		return nil, err
	}
	return m, nil
}

// register registers c with reg unless err is set already, and returns the
// collector in use: c, or the one of c's type already registered.
func register[C prometheus.Collector](reg prometheus.Registerer, c C, err error) (C, error) {
	if err != nil {
		return c, err
	}
	err = reg.Register(c)
	var are prometheus.AlreadyRegisteredError
	switch {
	case err == nil:
		return c, nil
	case errors.As(err, &are):
		if existing, ok := are.ExistingCollector.(C); ok {
			return existing, nil
		}
	}
	return c, fmt.Errorf("%w: register etcdsync metrics: %w", ErrInvalidArgument, err)
}

// marginCollector reports, at each scrape, the least time left before the
// local deadline of the live sessions that use it.
type marginCollector struct {
	desc     *prometheus.Desc
	mu       sync.Mutex
	sessions map[*queue.Session]struct{}
}

func (c *marginCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *marginCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	var least time.Time
	for s := range c.sessions {
		if d := s.Deadline(); least.IsZero() || d.Before(least) {
			least = d
		}
	}
	c.mu.Unlock()
	if !least.IsZero() {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, time.Until(least).Seconds())
	}
}

// WithLogger makes the session log one record per state change to l: session
// started and ended (with its cause), keepalive stream failures, holds
// acquired (wait time, fencing token), released and lost (with the cause).
// Losses and sessions that end on their own are logged at Warn, the rest at
// Debug. Attributes: name, key, rev, lease (hex), kind, and wait, held or
// cause. The default logs nothing and costs nothing.
func WithLogger(l *slog.Logger) SessionOption {
	return optionFunc(func(o *sessionOptions) { reportIn(o, func(r *report) { r.log = l }) })
}

// WithMetrics makes the session report to m (see NewMetrics). The default
// reports nothing and costs nothing. A hold's end is reported before its
// Done closes; a session's end, and that of the holds it ends, by the time
// Close returns (Done closes first).
func WithMetrics(m *Metrics) SessionOption {
	return optionFunc(func(o *sessionOptions) { reportIn(o, func(r *report) { r.m = m }) })
}

// report is where a session made WithLogger or WithMetrics reports: its
// reports (type reports, below) go to a logger, metrics, or both.
type report struct {
	log *slog.Logger
	m   *Metrics

	mu    sync.Mutex
	began map[*queue.Hold]time.Time // holds handed out and not yet ended (holdBegan, holdEnded)
}

// reportIn sets, through set, the report of the session o makes, made on
// first use; a report with neither a logger nor metrics is none.
func reportIn(o *sessionOptions, set func(*report)) {
	r, ok := o.Rep.(*report)
	if !ok {
		r = &report{began: make(map[*queue.Hold]time.Time)}
	}
	set(r)
	if r.log == nil && r.m == nil {
		o.Rep = nil
		return
	}
	o.Rep = r
}

// logs reports whether the logger takes records at level (the arguments of
// one it drops are never built).
func (r *report) logs(level slog.Level) bool {
	return r.log != nil && r.log.Enabled(context.Background(), level)
}

func (r *report) SessionBegan(s *queue.Session) {
	if r.m != nil {
		r.m.margin.add(s)
	}
	if r.logs(slog.LevelDebug) {
		r.log.Debug("etcdsync: session started", "lease", leaseHex(s.Lease()), "ttl", s.TTL())
	}
}

func (r *report) SessionEnded(s *queue.Session, cause error) {
	own := !errors.Is(cause, ErrSessionClosed)
	if r.m != nil {
		r.m.margin.remove(s)
		if own {
			r.m.sessionsExpired.WithLabelValues(lossCause(cause)).Inc()
		}
	}
	level := slog.LevelDebug
	if own {
		level = slog.LevelWarn
	}
	if r.logs(level) {
		r.log.Log(context.Background(), level, "etcdsync: session ended", "lease", leaseHex(s.Lease()), "cause", cause)
	}
}

func (r *report) KeepaliveFailed(s *queue.Session, err error) {
	if r.logs(slog.LevelDebug) {
		r.log.Debug("etcdsync: keepalive stream failed, retrying", "lease", leaseHex(s.Lease()), "error", err)
	}
}

func (r *report) KeepaliveAcked(_ *queue.Session, rtt time.Duration) {
	if r.m != nil {
		r.m.keepaliveRTT.Observe(rtt.Seconds())
	}
}

// ActedLate observes how late the loop ran, and warns when that is past
// half the slack (past a second with no slack): throttling is eating into
// what keeps a late holder safe.
func (r *report) ActedLate(s *queue.Session, late time.Duration) {
	if r.m != nil {
		r.m.lateness.Observe(late.Seconds())
	}
	warnAt := s.Slack() / 2
	if s.Slack() == 0 {
		warnAt = time.Second
	}
	if late > warnAt && r.logs(slog.LevelWarn) {
		r.log.Warn("etcdsync: session ran late", "lease", leaseHex(s.Lease()), "late", late, "slack", s.Slack())
	}
}

// shardFailed reports a Shards' fn that returned err while its shard was
// held (Shards.Run runs it again after a pause). A nil report reports
// nothing.
func (r *report) shardFailed(name string, shard int, err error) {
	if r == nil {
		return
	}
	if r.m != nil {
		r.m.shardErrors.Inc()
	}
	if r.logs(slog.LevelWarn) {
		r.log.Warn("etcdsync: shard function failed", "name", name, "shard", shard, "error", err)
	}
}

func (r *report) AcquireFailed(sl *queue.Slot, err error) {
	reason := acquireReason(err)
	if r.m != nil {
		r.m.acquireErrors.WithLabelValues(sl.Kind(), reason).Inc()
	}
	if r.logs(slog.LevelDebug) {
		r.log.Debug("etcdsync: acquire failed", "kind", sl.Kind(), "name", sl.Name(), "reason", reason, "error", err)
	}
}

func (r *report) HoldBegan(h *queue.Hold, wait time.Duration) {
	r.mu.Lock()
	if _, ok := r.began[h]; !ok { // a joined shared hold keeps its start
		r.began[h] = time.Now()
	}
	r.mu.Unlock()
	if r.m != nil {
		r.m.acquireWait.WithLabelValues(h.Kind()).Observe(wait.Seconds())
	}
	if r.logs(slog.LevelDebug) {
		r.log.Debug("etcdsync: hold acquired", "kind", h.Kind(), "name", h.Name(), "key", h.Key(), "rev", h.Rev(), "lease", leaseHex(h.Session().Lease()), "wait", wait)
	}
}

// HoldEnded reports a hold that ended: released or lost. A hold never
// handed out (holdBegan) is not reported.
func (r *report) HoldEnded(h *queue.Hold, cause error) {
	r.mu.Lock()
	began, ok := r.began[h]
	delete(r.began, h)
	r.mu.Unlock()
	if !ok {
		return
	}
	held := time.Since(began)
	released := errors.Is(cause, ErrLockReleased)
	if r.m != nil {
		r.m.holdSeconds.WithLabelValues(h.Kind()).Observe(held.Seconds())
		if !released {
			r.m.holdsLost.WithLabelValues(h.Kind(), lossCause(cause)).Inc()
		}
	}
	switch {
	case released && r.logs(slog.LevelDebug):
		r.log.Debug("etcdsync: hold released", "kind", h.Kind(), "name", h.Name(), "key", h.Key(), "rev", h.Rev(), "lease", leaseHex(h.Session().Lease()), "held", held)
	case !released && r.logs(slog.LevelWarn):
		r.log.Warn("etcdsync: hold lost", "kind", h.Kind(), "name", h.Name(), "key", h.Key(), "rev", h.Rev(), "lease", leaseHex(h.Session().Lease()), "held", held, "cause", cause)
	}
}

// lossCause is the cause label of a hold or session that ended with err.
func lossCause(err error) string {
	switch {
	case errors.Is(err, ErrLostContact):
		return "lost_contact"
	case errors.Is(err, ErrSessionClosed):
		return "session_closed"
	case errors.Is(err, ErrSessionExpired):
		return "lease_gone"
	case errors.Is(err, ErrNotHeld):
		return "key_deleted"
	}
	return "other"
}

// acquireReason is the reason label of an acquire that failed with err.
func acquireReason(err error) string {
	switch {
	case errors.Is(err, ErrLocked):
		return "locked"
	case errors.Is(err, ErrSessionExpired), errors.Is(err, ErrSessionClosed):
		return "session_ended"
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return "canceled"
	case errors.Is(err, ErrInvalidArgument), errors.Is(err, ErrInvalidName):
		return "invalid"
	}
	return "etcd"
}

func leaseHex(id clientv3.LeaseID) string { return fmt.Sprintf("%x", int64(id)) }

func (c *marginCollector) add(s *queue.Session) {
	c.mu.Lock()
	c.sessions[s] = struct{}{}
	c.mu.Unlock()
}

func (c *marginCollector) remove(s *queue.Session) {
	c.mu.Lock()
	delete(c.sessions, s)
	c.mu.Unlock()
}
