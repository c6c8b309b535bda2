# Copyright (c) idempotency authors
#
# The hostile-input corpus of t/006_fuzz.pl, generated deterministically
# (seeded), with the answer the contract (docs/reference.md, its SQLSTATEs and each
# function's section) gives for every case.
#
# A case calls one function (acquire, complete, release, lookup, hash) with
# edge and random keys, scopes, JSON, ttl, lease, status codes and attempts.
# Its expected answer is one of:
#   ok                  the call succeeds; the driver then checks the result
#                       and follows it with more calls (replay, mismatch...)
#   22004|22023 ...     one of these SQLSTATEs (a case can break several
#                       rules at once; the contract does not say which check
#                       comes first)
#   P0002, 55000, true, false   (complete / release on a given record state)
#   SIZE                the body is near max_response_bytes: 54000 exactly
#                       when pg_column_size(body) > max_response_bytes, which
#                       the driver measures, as the contract defines it
#   input:XXXXX         the value cannot even be made into the argument's
#                       type (jsonb rejects \u0000 with 22P05, a lone
#                       surrogate with 22P02, 100000 levels of nesting with
#                       54001; interval input rejects 2^31 days with 22015):
#                       PostgreSQL refuses it before any function of ours
#                       runs, so the function is not called.  The case proves
#                       the hostile value cannot reach us, and nothing more.
#
# Lengths are in bytes of UTF-8, as the contract counts them.

package IdemFuzz;

use strict;
use warnings;
use utf8;

use Encode qw(encode_utf8);
use Exporter 'import';
use Math::BigInt;

our @EXPORT_OK = qw(generate_corpus write_copy_file);

my $MAX_IDENT = 255;
my $USECS_PER_DAY = Math::BigInt->new('86400000000');
my $INT64_MAX = Math::BigInt->new('9223372036854775807');
my $MAX_TTL_US = Math::BigInt->new('604800000000');    # idempotency.max_ttl = 7d
my $DEFAULT_TTL_US = Math::BigInt->new('86400000000');  # default_ttl = 24h
my $DEFAULT_LEASE_US = Math::BigInt->new('60000000');   # default_lease = 60s

sub blen { return length(encode_utf8($_[0])); }

# ---------------------------------------------------------------------
# values
# ---------------------------------------------------------------------

# keys and scopes: [value, note]; validity is computed, not written down
sub edge_idents
{
	my @v = (
		[ undef, 'NULL' ],
		[ '', 'empty' ],
		[ 'a', 'one byte' ],
		[ 'x' x 254, '254 bytes' ],
		[ 'x' x 255, '255 bytes' ],
		[ 'x' x 256, '256 bytes' ],
		[ 'x' x 10000, '10000 bytes' ],
		[ 'é' x 127 . 'a', '2-byte chars, 255 bytes' ],
		[ 'é' x 128, '2-byte chars, 256 bytes (128 chars)' ],
		[ '€' x 85, '3-byte chars, 255 bytes' ],
		[ '€' x 85 . 'a', '3-byte chars, 256 bytes' ],
		[ '😀' x 63 . 'abc', '4-byte chars, 255 bytes' ],
		[ '😀' x 64, '4-byte chars, 256 bytes (64 chars)' ],
		[ 'x' x 253 . 'é', '2-byte char ending at byte 255' ],
		[ 'x' x 254 . 'é', '2-byte char crossing byte 255 (255 chars, 256 bytes)' ],
		[ 'x' x 252 . '😀', '4-byte char ending at byte 256' ],
		[ 'x' x 251 . '😀', '4-byte char ending at byte 255' ],
		[ "e\x{301}", 'combining accent' ],
		[ "\x{202e}evil", 'right-to-left override' ],
		[ "\x{feff}bom", 'byte order mark' ],
		[ "\x{200b}", 'zero-width space only' ],
		[ "\x{a0}", 'no-break space only' ],
		[ ' ', 'one space' ],
		[ '  padded  ', 'padded' ],
		[ "\x{10ffff}", 'last code point' ],
		[ "\x{fffd}", 'replacement char' ],
		[ q{'; DROP TABLE idempotency.records; --}, 'SQL injection' ],
		[ q{' OR '1'='1}, 'SQL tautology' ],
		[ q{$$; SELECT pg_sleep(10); $$}, 'dollar quoting' ],
		[ q{"; SELECT 1; --}, 'double quote' ],
		[ q{\\}, 'one backslash' ],
		[ q{\\\\'\\}, 'backslashes and quote' ],
		[ q{\\N}, 'backslash N (COPY NULL marker as text)' ],
		[ q{\\.}, 'backslash dot (COPY end marker as text)' ],
		[ 'NULL', 'the word NULL' ],
		[ q{%s%n%x%d}, 'format specifiers' ],
		[ q{${jndi:ldap://x/a}}, 'template injection' ],
		[ q{<script>alert(1)</script>}, 'HTML' ],
		[ q{../../../../etc/passwd}, 'path' ],
		[ q{E'\\x00'}, 'escape string text' ],
		[ q{*}, 'star' ],
		[ q{%}, 'LIKE wildcard' ],
		[ q{_}, 'LIKE single wildcard' ],
		[ q{[a-z]+}, 'regex' ],
		[ q{{"key": 1}}, 'JSON text' ],
		[ '0', 'zero' ],
		[ '-1', 'minus one' ],
		[ "a\tb\nc\rd", 'tab, newline, CR' ],
		[ "\x7f", 'DEL' ],
		[ "\x{85}", 'C1 control NEL' ],
	);
	push @v, [ chr($_), sprintf('control char \\x%02x', $_) ] foreach 1 .. 31;
	push @v, [ join('', map { chr } 1 .. 31), 'all control chars' ];
	push @v, [ (join('', map { chr } 1 .. 31) x 9), 'control chars, 279 bytes' ];
	return @v;
}

my @alphabet = (
	'a' .. 'z', 'A' .. 'Z', '0' .. '9', '-', '_', ':', '/', '.', ' ',
	"'", '"', '\\', '%', '$', ';', "\t", "\n", "\x01", "\x1f", 'é', 'ß', '€',
	'中', '😀', "\x{301}", "\x{2028}");

sub random_ident
{
	my ($maxlen) = @_;
	my $len = int(rand($maxlen)) + 1;
	my $s = '';
	$s .= $alphabet[ int(rand(@alphabet)) ] for 1 .. $len;
	return $s;
}

sub random_valid_key
{
	my $k;
	do { $k = random_ident(40) } while blen($k) > $MAX_IDENT;
	return $k;
}

# JSON texts: [text or undef, note, input-side SQLSTATE or undef]
sub nest_array { my ($d) = @_; return ('[' x $d) . '1' . (']' x $d); }
sub nest_object { my ($d) = @_; return ('{"a": ' x $d) . '1' . ('}' x $d); }

sub random_json
{
	my ($depth) = @_;
	my $r = rand();
	if ($depth > 4 || $r < 0.3)
	{
		my @scalars = ('null', 'true', 'false', '0', '-0', '1.50', '1e300', '-12345678901234567890',
			'""', '"é€😀"', '"\\u00e9"', '"\\ud83d\\ude00"', '"a\\"b"', '"\\\\"', '"\\n\\t"',
			'"\\u0001"', q{"'; DROP TABLE x; --"}, '123.456e-7');
		return $scalars[ int(rand(@scalars)) ];
	}
	if ($r < 0.65)
	{
		return '[' . join(', ', map { random_json($depth + 1) } 1 .. int(rand(4))) . ']';
	}
	my @pairs;
	foreach (1 .. int(rand(4)))
	{
		my $k = random_ident(8);
		$k =~ s/\\/\\\\/g;
		$k =~ s/"/\\"/g;
		$k =~ s/([\x00-\x1f])/sprintf('\\u%04x', ord($1))/ge;
		push @pairs, qq{"$k": } . random_json($depth + 1);
	}
	return '{' . join(', ', @pairs) . '}';
}

sub edge_json
{
	return (
		[ undef, 'NULL' ],
		[ '{}', 'empty object' ],
		[ '[]', 'empty array' ],
		[ 'null', 'JSON null (not SQL NULL)' ],
		[ '0', 'number' ],
		[ '""', 'empty string' ],
		[ '{"amount": 100, "currency": "usd"}', 'typical' ],
		[ '{"b": 1, "a": 2}', 'unordered keys' ],
		[ '{"a": 1, "a": 2}', 'duplicate keys (the last wins)' ],
		[ '{"a": 1, "a": 2, "a": {"a": [1, {"a": 3, "a": 4}]}}', 'nested duplicate keys' ],
		[ '{"a": "\\u00e9"}', 'unicode escape of a 2-byte char' ],
		[ '{"a": "\\ud83d\\ude00"}', 'unicode escape of a surrogate pair' ],
		[ '{"a": "\\u0001\\u001f"}', 'escaped control chars' ],
		[ '{"\\u0000": 1}', 'NUL in a key', '22P05' ],
		[ '"\\u0000"', 'NUL escape', '22P05' ],
		[ '{"a": "\\ud800"}', 'lone surrogate', '22P02' ],
		[ '{"a": ', 'truncated', '22P02' ],
		[ '{"a": 1e1000000}', 'exponent past numeric', '22003' ],
		[ '{"a": 1e131071}', 'a number of 131072 digits' ],
		[ '{"a": 1.0}', 'number with scale' ],
		[ '{"a": 1.00}', 'number with more scale' ],
		[ '  {  "spaced" :   [ 1 ,2 ]  }  ', 'white space' ],
		[ nest_array(100), 'arrays nested 100 deep' ],
		[ nest_array(1000), 'arrays nested 1000 deep' ],
		[ nest_array(2000), 'arrays nested 2000 deep' ],
		[ nest_object(1000), 'objects nested 1000 deep' ],
		[ nest_object(1500), 'objects nested 1500 deep' ],
		[ nest_array(100000), 'arrays nested 100000 deep', '54001' ],
		[ '{"big": "' . ('x' x 100000) . '"}', 'a 100 kB string' ],
		[ '[' . join(',', 1 .. 20000) . ']', 'an array of 20000 numbers' ],
		[ '{' . join(',', map { qq{"k$_": $_} } 1 .. 5000) . '}', 'an object of 5000 keys' ],
		[ q{{"sql": "'; DROP TABLE idempotency.records; --"}}, 'SQL in a string' ],
	);
}

# intervals: [text, microseconds (Math::BigInt) or 'overflow', note, input-side SQLSTATE]
sub iv
{
	my ($text, $months, $days, $us, $note, $input) = @_;
	return [ $text, undef, $note // 'NULL', undef ] unless defined $text;
	my $total = Math::BigInt->new($months)->bmul(30)->badd($days)->bmul($USECS_PER_DAY)
	  ->badd(Math::BigInt->new($us));
	# the extension computes in int64 (month*30, +day, *USECS_PER_DAY, +time):
	# any intermediate overflow means out of range
	my $days_total = Math::BigInt->new($months)->bmul(30)->badd($days);
	my $day_us = $days_total->copy->bmul($USECS_PER_DAY);
	my $over = $day_us->bacmp($INT64_MAX) > 0 || $total->bacmp($INT64_MAX) > 0;
	return [ $text, $over ? 'overflow' : $total, $note // $text, $input ];
}

sub edge_intervals
{
	return (
		iv(undef),
		iv('0', 0, 0, 0),
		iv('-1 s', 0, 0, -1_000_000),
		iv('1 microsecond', 0, 0, 1),
		iv('1 millisecond', 0, 0, 1000),
		iv('1 second', 0, 0, 1_000_000),
		iv('2 seconds', 0, 0, 2_000_000),
		iv('1 minute', 0, 0, 60_000_000),
		iv('1 hour', 0, 0, 3_600_000_000),
		iv('1 day', 0, 1, 0),
		iv('7 days', 0, 7, 0, '7 days = max_ttl'),
		iv('1 week', 0, 7, 0, '1 week = max_ttl'),
		iv('168 hours', 0, 0, '604800000000', '168 hours = max_ttl'),
		iv('6 days 24 hours', 0, 6, '86400000000', '6 days 24 hours = max_ttl'),
		iv('604800000000 microseconds', 0, 0, '604800000000', 'max_ttl in microseconds'),
		iv('7 days 00:00:00.000001', 0, 7, 1, 'max_ttl + 1 microsecond'),
		iv('604800000001 microseconds', 0, 0, '604800000001', 'max_ttl + 1 microsecond, as microseconds'),
		iv('6 days 24:00:00.000001', 0, 6, '86400000001', 'max_ttl + 1 microsecond, days and hours'),
		iv('8 days', 0, 8, 0),
		iv('1 mon', 1, 0, 0, '1 month (30 days)'),
		iv('1 year', 12, 0, 0),
		iv('1000000 years', 12_000_000, 0, 0),
		iv('178956970 years', 2_147_483_640, 0, 0, 'the largest year count'),
		iv('-178956970 years', -2_147_483_640, 0, 0),
		iv('2147483647 days', 0, 2_147_483_647, 0),
		iv('-2147483647 days', 0, -2_147_483_647, 0),
		iv('9223372036854775807 microseconds', 0, 0, '9223372036854775807', 'int64 max microseconds'),
		iv('1 day -23 hours', 0, 1, -82_800_000_000, 'mixed signs = 1 hour'),
		iv('-1 day 25 hours', 0, -1, 90_000_000_000, 'mixed signs = 1 hour (negative day)'),
		iv('1 day -24 hours', 0, 1, -86_400_000_000, 'mixed signs = 0'),
		iv('7 days -1 microsecond', 0, 7, -1, 'max_ttl - 1 microsecond'),
		iv('@ 7 days ago', 0, -7, 0, 'minus 7 days'),
		iv('1 mon -23 days', 1, -23, 0, '1 month - 23 days = 7 days'),
		iv('1 mon -22 days', 1, -22, 0, '1 month - 22 days = 8 days'),
		iv('2147483648 days', 0, 0, 0, 'day count past int32', '22015'),
	);
}

sub random_interval
{
	my $r = rand();
	if ($r < 0.4)
	{
		my $s = int(rand(800_000)) + 1;
		return iv("$s seconds", 0, 0, $s * 1_000_000);
	}
	if ($r < 0.7)
	{
		my $us = int(rand(700_000_000_000)) + 1;
		return iv("$us microseconds", 0, 0, "$us");
	}
	my $d = int(rand(10));
	my $h = int(rand(48)) - 24;
	return iv("$d days $h hours", 0, $d, $h * 3_600_000_000);
}

sub edge_statuses
{
	return (undef, 99, 100, 101, 199, 200, 201, 204, 301, 409, 422, 499, 500, 503, 599, 600,
		0, -1, -100, 1000, 2147483647, -2147483648);
}

sub edge_attempts { return (undef, undef, undef, 1, 2, 0, -1, 2147483647, -2147483648); }

# ---------------------------------------------------------------------
# expected answers
# ---------------------------------------------------------------------

sub ident_errors
{
	my ($v, $is_key) = @_;
	return ('22004') unless defined $v;
	return ('22023') if $is_key && $v eq '';
	return ('22023') if blen($v) > $MAX_IDENT;
	return ();
}

# ttl/lease: (errors, effective ttl us, effective lease us)
sub ttl_lease_errors
{
	my ($ttl, $lease) = @_;
	my ($ttl_us, $lease_us);
	if (!defined $ttl->[0])
	{
		$ttl_us = $DEFAULT_TTL_US->copy;
	}
	elsif ($ttl->[1] eq 'overflow' || $ttl->[1] <= 0 || $ttl->[1] > $MAX_TTL_US)
	{
		return ('22023');
	}
	else
	{
		$ttl_us = $ttl->[1];
	}
	if (!defined $lease->[0])
	{
		$lease_us = $DEFAULT_LEASE_US < $ttl_us ? $DEFAULT_LEASE_US->copy : $ttl_us->copy;
	}
	elsif ($lease->[1] eq 'overflow' || $lease->[1] <= 0 || $lease->[1] > $ttl_us)
	{
		return ('22023');
	}
	else
	{
		$lease_us = $lease->[1];
	}
	return ((), "$ttl_us", "$lease_us");
}

sub uniq_join { my %s = map { $_ => 1 } @_; return join('|', sort keys %s); }

# ---------------------------------------------------------------------
# the corpus
# ---------------------------------------------------------------------

sub generate_corpus
{
	my (%opt) = @_;
	srand($opt{seed} // 20260529);
	my $max_bytes = $opt{max_response_bytes} or die 'max_response_bytes';
	my $n_random = $opt{random_cases} // 3000;
	my @cases;
	my @idents = edge_idents();
	my @json = edge_json();
	my @ivs = edge_intervals();
	my @statuses = edge_statuses();

	my $add = sub {
		my (%c) = @_;
		$c{id} = scalar(@cases) + 1;
		push @cases, \%c;
	};

	# acquire
	my $acquire = sub {
		my ($key, $scope, $req, $ttl, $lease, $note) = @_;
		my (%c) = (fn => 'acquire', key => $key->[0], scope => $scope->[0],
			request => $req->[0], ttl => $ttl->[0], lease => $lease->[0]);
		$c{note} = "acquire: key $key->[1]; scope $scope->[1]; request $req->[1]; ttl $ttl->[2]; lease $lease->[2]"
		  . ($note ? "; $note" : '');
		if ($req->[2] || $ttl->[3] || $lease->[3])
		{
			# the first failing cast, in the driver's order: request, ttl, lease
			$c{expected} = 'input:' . ($req->[2] // $ttl->[3] // $lease->[3]);
			return $add->(%c);
		}
		my @err = (ident_errors($key->[0], 1), ident_errors($scope->[0], 0));
		my ($tl_err, $ttl_us, $lease_us) = ();
		my @tl = ttl_lease_errors($ttl, $lease);
		if (@tl == 1) { push @err, @tl; }
		else { ($ttl_us, $lease_us) = @tl; }
		if (@err)
		{
			$c{expected} = uniq_join(@err);
		}
		else
		{
			$c{expected} = 'ok';
			$c{ttl_us} = $ttl_us;
			$c{lease_us} = $lease_us;
		}
		$add->(%c);
	};

	my $valid_key = sub { return [ random_valid_key(), 'random valid' ] };
	my $null_iv = iv(undef);
	my $default_scope = [ '', 'empty (default)' ];

	# every edge key and every edge scope, alone
	foreach my $k (@idents)
	{
		$acquire->($k, $default_scope, [ '{"a": 1}', 'small' ], $null_iv, $null_iv);
		$acquire->($valid_key->(), $k, [ '{"a": 1}', 'small' ], $null_iv, $null_iv);
	}
	# every edge JSON
	foreach my $j (@json)
	{
		$acquire->($valid_key->(), $default_scope, $j, $null_iv, $null_iv);
	}
	# every edge ttl, with a NULL lease and with a 1 s lease
	foreach my $t (@ivs)
	{
		$acquire->($valid_key->(), $default_scope, [ '{"a": 1}', 'small' ], $t, $null_iv);
		$acquire->($valid_key->(), $default_scope, [ '{"a": 1}', 'small' ], $t, iv('1 second', 0, 0, 1_000_000));
	}
	# every edge lease, under a NULL ttl, a 1 hour ttl and the max ttl
	foreach my $l (@ivs)
	{
		foreach my $t ($null_iv, iv('1 hour', 0, 0, 3_600_000_000), iv('7 days', 0, 7, 0))
		{
			$acquire->($valid_key->(), $default_scope, [ '{"a": 1}', 'small' ], $t, $l);
		}
	}
	# lease equal to the ttl, and one microsecond more
	foreach my $s (2, 59, 3600, 86400, 604800)
	{
		my $us = $s * 1_000_000;
		$acquire->($valid_key->(), $default_scope, [ '{}', 'empty' ],
			iv("$s seconds", 0, 0, $us), iv("$s seconds", 0, 0, $us), 'lease = ttl');
		$acquire->($valid_key->(), $default_scope, [ '{}', 'empty' ],
			iv("$s seconds", 0, 0, $us), iv(($us + 1) . ' microseconds', 0, 0, $us + 1), 'lease = ttl + 1 microsecond');
	}

	# complete: every status, bodies, attempts; with and without a record
	my @bodies = (
		[ undef, 'NULL' ],
		[ '{"id": 1}', 'small' ],
		[ '"\\u0000"', 'NUL escape', '22P05' ],
		[ nest_array(1000), 'nested 1000 deep' ],
		[ '{"a": 1, "a": 2}', 'duplicate keys' ],
		[ '{"p": "' . ('x' x ($max_bytes + 10)) . '"}', 'one string longer than max_response_bytes', undef, '54000' ],
		[ '{"p": "' . ('x' x ($max_bytes * 3)) . '"}', 'three times max_response_bytes', undef, '54000' ],
		[ '{"p": "' . ('x' x ($max_bytes - 200)) . '"}', 'close under max_response_bytes', undef, 'SIZE' ],
		[ '{"p": "' . ('x' x ($max_bytes - 20)) . '"}', 'at max_response_bytes, roughly', undef, 'SIZE' ],
		[ '[' . join(',', map { '"é€"' } 1 .. int($max_bytes / 7)) . ']', 'many small multibyte strings near the limit', undef, 'SIZE' ],
	);
	my $complete = sub {
		my ($key, $scope, $status, $body, $attempt, $setup, $note) = @_;
		my %c = (fn => 'complete', key => $key->[0], scope => $scope->[0], status => $status,
			body => $body->[0], attempt => $attempt, setup => $setup ? 1 : 0);
		$c{note} = sprintf('complete: key %s; scope %s; status %s; body %s; attempt %s; %s',
			$key->[1], $scope->[1], $status // 'NULL', $body->[1], $attempt // 'NULL',
			$setup ? 'on a processing record' : 'no record') . ($note ? "; $note" : '');
		if ($body->[2])
		{
			$c{expected} = "input:$body->[2]";
			return $add->(%c);
		}
		my @err = (ident_errors($key->[0], 1), ident_errors($scope->[0], 0));
		push @err, '22004' unless defined $status;
		push @err, '22023' if defined $status && ($status < 100 || $status > 599);
		push @err, '22023' if defined $attempt && $attempt < 1;
		push @err, '54000' if ($body->[3] // '') eq '54000';
		if (@err)
		{
			# a body near the limit may add 54000 to the possible answers
			push @err, '54000' if ($body->[3] // '') eq 'SIZE';
			$c{expected} = uniq_join(@err);
		}
		elsif (($body->[3] // '') eq 'SIZE')
		{
			# 54000 or, within the limit, what follows
			$c{expected} = 'SIZE:' . (!$setup ? 'P0002' : (defined $attempt && $attempt != 1) ? '55000' : 'true');
		}
		elsif (!$setup) { $c{expected} = 'P0002'; }
		elsif (defined $attempt && $attempt != 1) { $c{expected} = '55000'; }
		else { $c{expected} = 'true'; }
		$add->(%c);
	};
	foreach my $st (@statuses)
	{
		$complete->($valid_key->(), $default_scope, $st, [ '{"id": 1}', 'small' ], undef, 1);
		$complete->($valid_key->(), $default_scope, $st, [ '{"id": 1}', 'small' ], undef, 0);
	}
	foreach my $b (@bodies)
	{
		foreach my $setup (1, 0)
		{
			$complete->($valid_key->(), $default_scope, 201, $b, undef, $setup);
		}
		$complete->($valid_key->(), $default_scope, 99, $b, undef, 1);
	}
	foreach my $a (edge_attempts())
	{
		$complete->($valid_key->(), $default_scope, 200, [ '{}', 'empty' ], $a, 1);
		$complete->($valid_key->(), $default_scope, 200, [ '{}', 'empty' ], $a, 0);
	}
	foreach my $k (@idents)
	{
		$complete->($k, $default_scope, 201, [ '{"id": 1}', 'small' ], undef, 1);
		$complete->($valid_key->(), $k, 201, [ '{"id": 1}', 'small' ], undef, 1);
	}

	# release
	my $release = sub {
		my ($key, $scope, $attempt, $setup) = @_;
		my %c = (fn => 'release', key => $key->[0], scope => $scope->[0], attempt => $attempt,
			setup => $setup ? 1 : 0);
		$c{note} = sprintf('release: key %s; scope %s; attempt %s; %s', $key->[1], $scope->[1],
			$attempt // 'NULL', $setup ? 'on a processing record' : 'no record');
		my @err = (ident_errors($key->[0], 1), ident_errors($scope->[0], 0));
		push @err, '22023' if defined $attempt && $attempt < 1;
		if (@err) { $c{expected} = uniq_join(@err); }
		elsif (!$setup) { $c{expected} = 'false'; }
		elsif (defined $attempt && $attempt != 1) { $c{expected} = '55000'; }
		else { $c{expected} = 'true'; }
		$add->(%c);
	};
	foreach my $k (@idents)
	{
		$release->($k, $default_scope, undef, 1);
		$release->($valid_key->(), $k, undef, 1);
	}
	foreach my $a (edge_attempts())
	{
		$release->($valid_key->(), $default_scope, $a, 1);
		$release->($valid_key->(), $default_scope, $a, 0);
	}

	# lookup
	my $lookup = sub {
		my ($key, $scope, $setup) = @_;
		my %c = (fn => 'lookup', key => $key->[0], scope => $scope->[0], setup => $setup ? 1 : 0);
		$c{note} = sprintf('lookup: key %s; scope %s; %s', $key->[1], $scope->[1],
			$setup ? 'on a processing record' : 'no record');
		my @err = (ident_errors($key->[0], 1), ident_errors($scope->[0], 0));
		$c{expected} = @err ? uniq_join(@err) : 'ok';
		$add->(%c);
	};
	foreach my $k (@idents)
	{
		$lookup->($k, $default_scope, 1);
		$lookup->($valid_key->(), $k, 0);
	}

	# hash
	foreach my $j (@json)
	{
		my %c = (fn => 'hash', request => $j->[0], note => "hash: $j->[1]");
		$c{expected} = $j->[2] ? "input:$j->[2]" : 'ok';
		$add->(%c);
	}

	# random combinations
	my @small_json = grep { !defined $_->[2] && (!defined $_->[0] || length($_->[0]) < 2000) } @json;
	for (1 .. $n_random)
	{
		my $r = rand();
		my $pick_ident = sub {
			my $x = rand();
			return $x < 0.6 ? [ random_ident(30), 'random' ]
			  : $x < 0.8 ? $idents[ int(rand(@idents)) ]
			  : [ random_ident(300), 'random long' ];
		};
		my $pick_json = sub {
			return rand() < 0.5 ? [ random_json(0), 'random' ] : $small_json[ int(rand(@small_json)) ];
		};
		my $pick_iv = sub {
			my $x = rand();
			return $x < 0.3 ? $null_iv : $x < 0.6 ? $ivs[ int(rand(@ivs)) ] : random_interval();
		};
		if ($r < 0.45)
		{
			$acquire->($pick_ident->(), rand() < 0.5 ? $default_scope : $pick_ident->(),
				$pick_json->(), $pick_iv->(), rand() < 0.5 ? $null_iv : $pick_iv->());
		}
		elsif ($r < 0.7)
		{
			my $st = rand() < 0.5 ? $statuses[ int(rand(@statuses)) ] : int(rand(800)) - 50;
			my $b = $pick_json->();
			$complete->($pick_ident->(), rand() < 0.5 ? $default_scope : $pick_ident->(), $st,
				$b, (edge_attempts())[ int(rand(9)) ], rand() < 0.7);
		}
		elsif ($r < 0.85)
		{
			$release->($pick_ident->(), rand() < 0.5 ? $default_scope : $pick_ident->(),
				(edge_attempts())[ int(rand(9)) ], rand() < 0.7);
		}
		elsif ($r < 0.95)
		{
			$lookup->($pick_ident->(), rand() < 0.5 ? $default_scope : $pick_ident->(), rand() < 0.5);
		}
		else
		{
			my $j = $pick_json->();
			$add->(fn => 'hash', request => $j->[0], note => "hash: $j->[1]", expected => 'ok');
		}
	}
	return \@cases;
}

# COPY text format: \N for NULL; backslash, newline, CR and tab escaped
sub copy_field
{
	my ($v) = @_;
	return '\N' unless defined $v;
	$v =~ s/\\/\\\\/g;
	$v =~ s/\n/\\n/g;
	$v =~ s/\r/\\r/g;
	$v =~ s/\t/\\t/g;
	return $v;
}

our @COLUMNS = qw(id fn key scope request ttl lease status body attempt setup expected ttl_us lease_us note);

sub write_copy_file
{
	my ($cases, $file) = @_;
	open my $fh, '>:raw', $file or die "$file: $!";
	foreach my $c (@$cases)
	{
		# encode_utf8 is lax: noncharacters such as U+10FFFF are written as
		# they are (PostgreSQL accepts them)
		print $fh encode_utf8(join("\t", map { copy_field($c->{$_}) } @COLUMNS)), "\n";
	}
	close $fh;
}

1;
